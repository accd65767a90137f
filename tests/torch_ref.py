"""The GPT in PyTorch, from the same parameters: the benchmark's reference columns, where torch is importable (the GPU machine has it;
CI doesn't install it): the clean forward under torch.compile, and a backprop step (SGD with momentum, as the bench's backprop row) in
bf16, eager and compiled. It mirrors model.GPT.losses line for line; tests/bench.py checks that both give the same mean loss before it
times anything."""
import time
import numpy as np
import torch
import torch.nn.functional as F

def rms(x:torch.Tensor) -> torch.Tensor: return x * (x.float().square().mean(-1, keepdim=True) + 1e-6).rsqrt().to(x.dtype)

def rope(x:torch.Tensor, cos:torch.Tensor, sin:torch.Tensor) -> torch.Tensor:
  a, b = x.chunk(2, dim=-1)
  return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)

class GPT:
  def __init__(self, cfg, arrays:dict[str, np.ndarray], device:str, dtype:torch.dtype):
    """cfg: model.GPTConfig; arrays: the parameters by name, and the RoPE tables "cos" and "sin" (model.GPT's)."""
    self.cfg, self.dtype = cfg, dtype
    self.p = {n: torch.from_numpy(a).to(device) for n, a in arrays.items() if n not in ("cos", "sin")}
    self.cos, self.sin = [torch.from_numpy(arrays[n]).to(device) for n in ("cos", "sin")]
    T = self.cfg.seq_len
    lag = torch.arange(T, device=device).reshape(T, 1) - torch.arange(T, device=device).reshape(1, T)
    self.masks = {w: (lag >= 0) & (lag <= w) for w in {self.cfg.window(i) for i in range(self.cfg.n_layer)}}

  def linear(self, name:str, x:torch.Tensor) -> torch.Tensor: return x.to(self.dtype) @ self.p[name + ".weight"].to(self.dtype).T

  def attn(self, i:int, n:torch.Tensor, idx:torch.Tensor) -> torch.Tensor:
    B, T, d = n.shape
    H, pre = self.cfg.n_head, f"transformer.h.{i}.attn"
    q, k, v = [self.linear(f"{pre}.{c}", n).reshape(B, T, H, d // H) for c in ("c_q", "c_k", "c_v")]
    if self.cfg.has_ve(i):
      e = self.p[f"value_embeds.{i}.weight"].to(self.dtype)[idx].reshape(B, T, H, d // H)
      v = v + (2 * self.linear(f"{pre}.ve_gate", n[..., :min(32, d)]).float().sigmoid()).to(self.dtype).unsqueeze(-1) * e
    q, k = rms(rope(q.float(), self.cos[:T], self.sin[:T])), rms(rope(k.float(), self.cos[:T], self.sin[:T]))
    q, k, v = [t.transpose(1, 2).to(self.dtype) for t in (q, k, v)]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks[self.cfg.window(i)][:T, :T])
    return y.transpose(1, 2).reshape(B, T, d)

  def losses(self, idx:torch.Tensor, targets:torch.Tensor) -> torch.Tensor:
    x0 = rms(self.p["transformer.wte.weight"].to(self.dtype)[idx].float())
    x = x0
    for i in range(self.cfg.n_layer):
      h = self.p["resid_lambdas"][i] * x + self.p["x0_lambdas"][i] * x0
      a = h + self.linear(f"transformer.h.{i}.attn.c_proj", self.attn(i, rms(h).to(self.dtype), idx)).float()
      hid = self.linear(f"transformer.h.{i}.mlp.c_fc", rms(a).to(self.dtype))
      x = a + self.linear(f"transformer.h.{i}.mlp.c_proj", hid.relu().square()).float()
    z = self.linear("lm_head", rms(x).to(self.dtype)).float()
    c = self.cfg.softcap * torch.tanh(z / self.cfg.softcap)
    return F.cross_entropy(c.reshape(-1, c.shape[-1]), targets.reshape(-1), reduction="none").reshape(targets.shape)

def forward_tok_s(cfg, arrays:dict[str, np.ndarray], x:np.ndarray, y:np.ndarray, n:int=10) -> tuple[float, float]:
  """(clean forward tokens/s under torch.compile, its mean loss) on the GPU if there is one, else the CPU."""
  device = "cuda" if torch.cuda.is_available() else "cpu"
  ref = GPT(cfg, arrays, device, torch.float16 if device == "cuda" else torch.float32)
  xt, yt = (torch.from_numpy(a.astype(np.int64)).to(device) for a in (x, y))
  with torch.no_grad():
    f = torch.compile(ref.losses)
    for _ in range(3): loss = f(xt, yt).mean().item()
    if device == "cuda": torch.cuda.synchronize()
    st = time.perf_counter()
    for _ in range(n): f(xt, yt)
    if device == "cuda": torch.cuda.synchronize()
  return x.size * n / (time.perf_counter() - st), loss

def backprop_step(cfg, arrays:dict[str, np.ndarray], x:np.ndarray, y:np.ndarray, compiled:bool, n:int=10) -> tuple[float, float]:
  """(seconds a step, peak GiB allocated) of backprop on the GPU: the mean loss's gradient by autograd, the forward in bf16 from float32
  parameters (as a user of PyTorch would train), then SGD with momentum; the forward under torch.compile if `compiled`."""
  ref = GPT(cfg, arrays, "cuda", torch.bfloat16)
  params = [p.requires_grad_(True) for p in ref.p.values()]
  opt = torch.optim.SGD(params, lr=1e-5, momentum=0.9)  # a small lr: the timed steps leave the weights near where they were
  xt, yt = (torch.from_numpy(a.astype(np.int64)).cuda() for a in (x, y))
  f = torch.compile(ref.losses) if compiled else ref.losses
  def step():
    opt.zero_grad(set_to_none=True)
    f(xt, yt).mean().backward()
    opt.step()
  for _ in range(3): step()
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  st = time.perf_counter()
  for _ in range(n): step()
  torch.cuda.synchronize()
  return (time.perf_counter() - st) / n, torch.cuda.max_memory_allocated() / 2**30

if __name__ == "__main__":  # tests/bench.py: python torch_ref.py in.npz config.json [forward|backprop]; in.npz: the batch x, y and GPT's arrays
  import json, os, sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from model import GPTConfig  # the config only: no tinygrad device is opened in this process
  data = dict(np.load(sys.argv[1]))
  x, y = data.pop("x"), data.pop("y")
  cfg = GPTConfig(**json.loads(sys.argv[2]))
  if sys.argv[3:] == ["backprop"]: print(*backprop_step(cfg, data, x, y, False), *backprop_step(cfg, data, x, y, True))
  else: print(*forward_tok_s(cfg, data, x, y))

