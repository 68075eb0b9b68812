"""transformers' own decode loop: a Llama step with a StaticCache and with a DynamicCache, eager vs torch.compile
(Inductor) vs vtc, side by side in one process.

    PYTHONPATH=$PWD python -m bench.hf_decode [--cache 2048] [--threads 2] [--rounds 15] [--out FILE]

The model is ``llama_model``'s (transformers Llama, 4 layers, hidden 512, GQA 8/2, vocab 32000, random weights
from its config).  A prompt of 32 tokens fills each system's own cache, then:

- **static**: one-token steps at a fixed position with a ``StaticCache`` of ``--cache`` tokens (what
  transformers recommends for compiled decoding: the cache is updated in place with ``index_copy_``).  Each
  system's call is timed alternately; medians and minimums after warm-up, ms.  The logits are compared with
  eager's (max abs error) and each system's cache with eager's after the same steps.
- **dynamic**: eight one-token steps with a ``DynamicCache`` (a new cache length every step): the wall time of
  each step, the first one (a new capture / compile) reported apart from the median of the others.

Compile time (the first call) is printed too.  The results go to ``--out`` (default
``bench/results/hf-decode-<host>-<date>.json``).
"""
from __future__ import annotations

import argparse
import copy
import json
import socket
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def _model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    return cfg, tf.LlamaForCausalLM(cfg).eval()


def _systems(model, example: tuple, kwargs: dict) -> dict:
    import vtc

    return {"eager": model, "inductor": torch.compile(model), "vtc": vtc.compile(model, example, kwargs)}


def static(cfg, model, cache_len: int, rounds: int) -> dict:
    import transformers as tf

    prompt = torch.randint(1, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    base = tf.StaticCache(config=cfg, max_cache_len=cache_len)
    with torch.no_grad():
        first = model(prompt, cache=base, cache_position=torch.arange(32))
    tok = first.logits[:, -1:].argmax(-1)
    pos = torch.tensor([32])
    caches = {}
    systems = _systems(model, (tok,), {"cache": copy.deepcopy(base), "cache_position": pos})
    out, compile_s, logits = {}, {}, {}
    with torch.no_grad():
        for name, fn in systems.items():
            caches[name] = copy.deepcopy(base)
            t = time.perf_counter()
            logits[name] = fn(tok, cache=caches[name], cache_position=pos).logits  # writes position 32
            compile_s[name] = time.perf_counter() - t
        times = {name: [] for name in systems}
        for r in range(rounds + 3):
            for name, fn in systems.items():
                t = time.perf_counter()
                fn(tok, cache=caches[name], cache_position=pos)  # the same position again: the same work
                if r >= 3:
                    times[name].append(time.perf_counter() - t)
    for name in systems:
        err = (logits[name] - logits["eager"]).abs().max().item()
        cache_err = max((a.keys - b.keys).abs().max().item()
                        for a, b in zip(caches[name].layers, caches["eager"].layers))
        out[name] = dict(median_ms=1e3 * statistics.median(times[name]), min_ms=1e3 * min(times[name]),
                         first_call_s=compile_s[name], max_abs_err=err, cache_max_abs_err=cache_err)
    return out


def dynamic(cfg, model, steps: int = 8) -> dict:
    prompt = torch.randint(1, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = model(prompt)
    tok = first.logits[:, -1:].argmax(-1)
    systems = _systems(model, (tok,), {"cache": copy.deepcopy(first.past_key_values)})
    out = {}
    with torch.no_grad():
        for name, fn in systems.items():
            cache, took, t_tok = copy.deepcopy(first.past_key_values), [], tok
            for _ in range(steps):
                t = time.perf_counter()
                res = fn(t_tok, cache=cache)
                took.append(time.perf_counter() - t)
                cache, t_tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            out[name] = dict(first_step_s=took[0], median_step_ms=1e3 * statistics.median(took[1:]),
                             max_step_ms=1e3 * max(took[1:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, model = _model()
    result = dict(command=f"python -m bench.hf_decode --cache {args.cache} --threads {args.threads} "
                          f"--rounds {args.rounds}", threads=args.threads, cache=args.cache,
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  static=static(cfg, model, args.cache, args.rounds), dynamic=dynamic(cfg, model))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    path = args.out or Path("bench/results") / f"hf-decode-{socket.gethostname()}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for kind in ("static", "dynamic"):
        for name, r in result[kind].items():
            print(kind, name, {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in r.items()})
    print("written", path)


if __name__ == "__main__":
    main()
