"""Values computed from the model's tensors, folded once or computed per call, timed side by side in one process.

    python -m bench.param_fold [--models wav2vec2_pos_conv,wn_linear,t5_small,...] [--rounds 30]

Each model is compiled twice: with ``vtc.ir.fold.fold_weight_chains`` (the fold of session 23) and with it switched
off (none of these models has a weight behind a movement chain, so that is the compiler before session 23).  Calls
alternate between torch eager and the two, 1 thread, CPU time of the calling thread; per model the median ms per
call over the rounds (the first 3 dropped), the steps each runs, the folded copies and their bytes.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

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


MODELS = {f.__name__: f for f in (wav2vec2_pos_conv, wn_linear, t5_small, t5_small_no_mask, llama_small)}


def compiled(model, inputs, folded: bool):
    keep = fold.fold_weight_chains
    if not folded:
        fold.fold_weight_chains = lambda graph: graph
    try:
        return vtc.compile(model, inputs)
    finally:
        fold.fold_weight_chains = keep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        with torch.no_grad():
            runs = {"eager": model, "before": compiled(model, inputs, False), "after": compiled(model, inputs, True)}
            times = {k: [] for k in runs}
            for r in range(args.rounds + 3):
                for k, f in runs.items():
                    t0 = time.thread_time()
                    f(*inputs)
                    if r >= 3:
                        times[k].append(time.thread_time() - t0)
        after = runs["after"]._first
        copies = after.graph.meta.get("const_copies", {})
        print(f"{name}: " + "  ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items())
              + f"  steps {len(runs['before']._first.executor.steps)} -> {len(after.executor.steps)}"
              + f"  folded {len(copies)} copies, {sum(c.value.nbytes for c in copies.values()) / 1024:.1f} KB, "
              + f"{after.graph.meta.get('const_copy_nodes', 0)} nodes", flush=True)


if __name__ == "__main__":
    main()
