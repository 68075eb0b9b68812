"""Values computed from the model's tensors, folded once or computed per call, timed side by side in one process.

    python -m bench.param_fold [--models wav2vec2_pos_conv,wn_linear,t5_small,...] [--rounds 30]
    python -m bench.param_fold --broadcast [--models t5_small_no_mask_b4]
    python -m bench.param_fold --dynamic [--models wav2vec2_pos_conv,wn_linear,llama_small] [--sizes 49,61,77]
    python -m bench.param_fold --static [--models wav2vec2_pos_conv,wn_linear] [--sizes 49,61,77]

Each model is compiled twice: with ``vtc.ir.fold.fold_weight_chains`` (the fold of session 23) and with it switched
off (none of these models has a weight behind a movement chain, so that is the compiler before session 23).  Calls
alternate between torch eager and the two, 1 thread, CPU time of the calling thread; per model the median ms per
call over the rounds (the first 3 dropped), the steps each runs, the folded copies and their bytes.

``--broadcast``: "before" is the fold holding a pointwise broadcast whole (``fold._broadcast_dims`` switched off, the
fold of session 23), "after" holds it without its broadcast dims (session 24).

``--dynamic``: ``vtc.compile(..., dynamic=True)`` called at each of ``--sizes`` (frames, rows or tokens: ``RESIZE``);
"before" with the fold switched off under vtc.dynamic
(session 23's vtc.dynamic folded nothing), "after" with it.  Per size the median ms per call, then the CPU time
of the first call at each size (the specialization: planning, lowering, the fold; kernels from the disk cache,
every size visited once before by a throwaway compile) and the bytes of the distinct folded copies the sizes hold.

``--static``: ``vtc.compile(..., dynamic=False)`` called at each of ``--sizes`` (a capture per size); the bytes of
the distinct folded copies and of everything held against the packed-weight budget, with the copies shared by
recipe (session 24) and not (``fold._shared_key`` switched off: a copy per specialization, as before).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings
from unittest.mock import patch

import torch

import vtc
from vtc.ir import fold


def wav2vec2_pos_conv():
    """Wav2Vec2-base's positional convolution (768 channels, kernel 128, 16 groups, weight_norm over the kernel
    dim), GELU, on 1 s of audio's 49 frames."""
    import transformers as tf
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2PositionalConvEmbedding

    model = Wav2Vec2PositionalConvEmbedding(tf.Wav2Vec2Config()).eval()
    return model, (torch.randn(1, 49, 768),)


def wn_linear():
    """A weight-normalised Linear 1024 -> 1024 on 8 rows."""
    from torch.nn.utils.parametrizations import weight_norm

    return weight_norm(torch.nn.Linear(1024, 1024)).eval(), (torch.randn(8, 1024),)


def t5_small(mask: bool = True):
    """A t5-small-sized encoder (d_model 512, 6 layers, 8 heads, random weights), 1 x 128 tokens with a mask."""
    import transformers as tf

    cfg = tf.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, use_cache=False)
    ids = torch.randint(1, 32128, (1, 128))
    return tf.T5EncoderModel(cfg).eval(), (ids, torch.ones(1, 128, dtype=torch.long)) if mask else (ids,)


def t5_small_no_mask():
    """t5_small without the mask: the bias is added to the scores through a where in each layer."""
    return t5_small(mask=False)


def llama_small():
    """A Llama (hidden 512, 4 layers, 8 heads, 2 KV heads, random weights) on 1 x 128 tokens: RoPE's cos and sin
    tables are computed from the inv_freq buffer."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, use_cache=False)
    return tf.LlamaModel(cfg).eval(), (torch.randint(1, 1000, (1, 128)),)


def t5_small_no_mask_b4():
    """t5_small without the mask at 4 x 128 tokens: the bias is [4, 8, 128, 128] as the where makes it."""
    model, (ids,) = t5_small(mask=False)
    return model, (torch.randint(1, 32128, (4, 128)),)


MODELS = {f.__name__: f for f in (wav2vec2_pos_conv, wn_linear, t5_small, t5_small_no_mask, llama_small,
                                  t5_small_no_mask_b4)}
# per model of --dynamic: its inputs at one size (frames, rows, tokens)
RESIZE = {"wav2vec2_pos_conv": lambda n: (torch.randn(1, n, 768),), "wn_linear": lambda n: (torch.randn(n, 1024),),
          "llama_small": lambda n: (torch.randint(1, 1000, (1, n)),)}


def compiled(model, inputs, folded: bool):
    with patch.object(fold, "fold_weight_chains", fold.fold_weight_chains if folded else (lambda graph: graph)):
        return vtc.compile(model, inputs)


def compiled_broadcast(model, inputs, whole: bool):
    if not whole:
        return vtc.compile(model, inputs)
    with patch.object(fold, "_broadcast_dims", lambda *a: ()):
        return vtc.compile(model, inputs)


def dynamic_run(model, sizes: list[int], resize, folded: bool, rounds: int) -> None:
    """Prints, per size, the median ms per call, the specialization's CPU time and the distinct copies' bytes."""
    import vtc.dynamic

    def fresh():
        return vtc.compile(model, resize(sizes[0]), dynamic=True)

    with patch.object(vtc.dynamic, "fold_constants", vtc.dynamic.fold_constants if folded else (lambda g: g)):
        warm = fresh()
        for n in sizes:  # every kernel into the disk cache
            warm(*resize(n))
        del warm
        gc.collect()
        c = fresh()
        first_call = {}
        for n in sizes:
            x = resize(n)
            t0 = time.thread_time()
            c(*x)
            first_call[n] = time.thread_time() - t0
    times = {n: [] for n in sizes}
    inputs = {n: resize(n) for n in sizes}
    for r in range(rounds + 3):
        for n in sizes:
            t0 = time.thread_time()
            c(*inputs[n])
            if r >= 3:
                times[n].append(time.thread_time() - t0)
    copies = {id(x): x for s in c._specs.values() for x in s.graph.meta.get("const_copies", {}).values()}
    label = "after " if folded else "before"
    print(f"  {label}: " + "  ".join(f"{n}: {statistics.median(times[n]) * 1e3:.3f} ms" for n in sizes)
          + "  | specialization " + " ".join(f"{first_call[n] * 1e3:.0f}" for n in sizes[1:]) + " ms"
          + f"  | {len(copies)} distinct copies, {sum(x.value.nbytes for x in copies.values()) / 1024:.1f} KB, "
          + f"{len(c._specs)} specializations", flush=True)


def static_run(model, sizes: list[int], resize, shared: bool) -> None:
    """Prints the bytes of the distinct folded copies and of all packed copies held by a model compiled with
    dynamic=False and called at each size (a capture per size), with the copies shared by recipe or not."""
    from vtc.runtime import packed

    gc.collect()
    held = packed.HELD.bytes
    with patch.object(fold, "_shared_key", fold._shared_key if shared else (lambda *a: None)):
        c = vtc.compile(model, resize(sizes[0]), dynamic=False)
        for n in sizes:
            c(*resize(n))
    copies = {id(x): x for s in c._specs.values() for x in s.graph.meta.get("const_copies", {}).values()}
    print(f"  {'shared    ' if shared else 'not shared'}: {len(c._specs)} specializations, {len(copies)} distinct "
          f"copies, {sum(x.value.nbytes for x in copies.values()) / 2**20:.1f} MB; packed-weight budget held "
          f"{(packed.HELD.bytes - held) / 2**20:.1f} MB", flush=True)
    del c
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--broadcast", action="store_true")
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--sizes", default="49,61,77,93")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    default = ",".join(RESIZE) if args.dynamic or args.static else "t5_small_no_mask_b4" if args.broadcast else ",".join(MODELS)
    for name in (args.models or default).split(","):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        if args.static:
            print(f"{name}:", flush=True)
            with torch.no_grad():
                for shared in (False, True):
                    static_run(model, [int(n) for n in args.sizes.split(",")], RESIZE[name], shared)
            continue
        if args.dynamic:
            print(f"{name} (uptime {os.getloadavg()[0]:.1f}):", flush=True)
            with torch.no_grad():
                for folded in (False, True):
                    dynamic_run(model, [int(n) for n in args.sizes.split(",")], RESIZE[name], folded, args.rounds)
            continue
        with torch.no_grad():
            if args.broadcast:
                before, after = compiled_broadcast(model, inputs, True), compiled_broadcast(model, inputs, False)
            else:
                before, after = compiled(model, inputs, False), compiled(model, inputs, True)
            runs = {"eager": model, "before": before, "after": after}
            times = {k: [] for k in runs}
            for r in range(args.rounds + 3):
                for k, f in runs.items():
                    t0 = time.thread_time()
                    f(*inputs)
                    if r >= 3:
                        times[k].append(time.thread_time() - t0)
        after = runs["after"]._first
        copies = after.graph.meta.get("const_copies", {})
        held = sum(c.value.nbytes for c in runs["before"]._first.graph.meta.get("const_copies", {}).values())
        print(f"{name}: " + "  ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items())
              + f"  steps {len(runs['before']._first.executor.steps)} -> {len(after.executor.steps)}"
              + f"  folded {len(copies)} copies, {held / 1024:.1f} -> "
              + f"{sum(c.value.nbytes for c in copies.values()) / 1024:.1f} KB, "
              + f"{after.graph.meta.get('const_copy_nodes', 0)} nodes", flush=True)


if __name__ == "__main__":
    main()
