"""Tests of --patience and --keep-best: a run that overfits on purpose (400 tokens, of which it learns the rule, then memorizes the
noise) stops at the step its metrics say, its kept weights have the logged best val, and a run stopped and resumed is the run that
wasn't stopped, kept weights and all.

Cost: backprop-AdamW on the tiny GPT at vocab 16, 4x16 tokens a step, in this process (one compile for the three runs)."""
import contextlib, io, json
from pathlib import Path
import numpy as np
import pytest
from safetensors import safe_open
import data, rundir, zo

RUN = ["--method", "backprop", "--optim", "adamw", "--lr", "0.01", "--model", "tiny", "--vocab", "16", "--seq", "16", "--batch", "4",
       "--eval-every", "1", "--ckpt-every", "100", "--patience", "3", "--keep-best", "--steps", "40"]

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
  """The same run whole, and stopped after 26 steps (its best two evaluations behind) then resumed, with what they printed. Their
  data: 400 tokens of a chain that goes from s to s + 1 (mod 16) 70% of the time and anywhere else 30%, its last 10% for
  validation: at lr 0.01 the val loss falls while the model learns the rule (to 1.39 at step 24), then rises as it memorizes the
  360 tokens' noise."""
  tmp, rng = tmp_path_factory.mktemp("patience"), np.random.default_rng(0)
  ids = np.zeros(400, np.int64)
  for i in range(1, len(ids)): ids[i] = (ids[i - 1] + 1) % 16 if rng.random() < 0.7 else rng.integers(16)
  np.save(path := tmp / "ids.npy", ids)
  with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(said := io.StringIO()):
    mp.setattr(zo, "on_signals", lambda *a: contextlib.nullcontext())  # the signal thread would be the test process's
    zo.main([*RUN, "--data", str(path), "--out", str(tmp / "whole")])
    zo.main([*RUN, "--data", str(path), "--out", str(tmp / "split"), "--steps", "26"])
    zo.main([*RUN, "--data", str(path), "--out", str(tmp / "split"), "--resume"])
    # step 0's val is measured after its update: at lr 1e-30 below float32's resolution of the weights, so it is the kept weights'
    zo.main([*RUN, "--data", str(path), "--out", str(tmp / "init"), "--init", str(tmp / "whole"), "--best", "--lr", "1e-30", "--steps", "1"])
  return {"whole": tmp / "whole", "split": tmp / "split", "init": tmp / "init", "ids": path, "said": said.getvalue()}

def metrics(out:Path) -> list[dict]: return [json.loads(line) for line in open(out / "metrics.jsonl")]

# protects: --patience N stops the run (exit 0) after the N-th evaluation in a row that brings no new best val loss, as its own
# metrics.jsonl counts them: not before, not after; and it says so
def test_stops_where_the_metrics_say(runs):
  vals = [r["val_loss"] for r in metrics(runs["whole"])]
  since, stop = 0, None
  for step, v in enumerate(vals):
    since = 0 if v < min(vals[:step], default=np.inf) else since + 1
    if since == 3: stop = step; break
  assert stop is not None and 10 <= stop < 39 and len(vals) == stop + 1, vals  # it learns, overfits and stops early
  assert f"--patience 3: 3 evaluations without a val loss below {min(vals):.4f} (step {stop - 3}): stopped after step {stop}" in \
    runs["said"], runs["said"]

# protects: --keep-best keeps the weights of the best val loss with its step and val, and evaluated again they give that val, as they do
# where --init RUN --best starts a run from them
def test_kept_weights_have_the_best_val(runs):
  m = metrics(runs["whole"])
  best = min(m, key=lambda r: r["val_loss"])
  meta = kept(runs["whole"])[0]
  assert int(meta["step"]) == best["step"] and float(meta["val_loss"]) == best["val_loss"], (meta, best)
  args = zo.parse([*RUN, "--data", str(runs["ids"]), "--out", str(runs["whole"])])
  model = zo.make_model(args)
  rundir.load_checkpoint(str(runs["whole"]), model, "--sample", keep="param.", name=rundir.BEST)
  src = data.load(str(runs["ids"]), 16, 16, 0)
  assert zo.val_loss(model, src, args) == pytest.approx(best["val_loss"], rel=1e-6)
  assert metrics(runs["init"])[0]["val_loss"] == pytest.approx(best["val_loss"], rel=1e-6)

# protects: the best val so far and the evaluations since it are the run's state: a run stopped after 3 steps and resumed stops where
# the whole run stopped, with the same losses and the same kept weights
def test_stopped_and_resumed_is_the_whole_run(runs):
  assert metrics(runs["split"]) == [r | {"seconds": s["seconds"]} for r, s in zip(metrics(runs["whole"]), metrics(runs["split"]))]
  assert len(metrics(runs["split"])) == len(metrics(runs["whole"]))
  (ma, ta), (mb, tb) = kept(runs["split"]), kept(runs["whole"])
  assert ma == mb and ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta), (ma, mb)

def kept(out:Path) -> tuple[dict, dict]:  # the metadata and the tensors of a run's kept best weights (safetensors orders its header anyhow)
  with safe_open(str(out / rundir.BEST), "np") as f: return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
