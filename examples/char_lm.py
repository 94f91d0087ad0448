"""A character-level language model: a small causal transformer on a real text corpus.

The corpus is the Lee background corpus that gensim ships (300 news articles,
360,082 characters; ``pip install 'mpidist[datasets]'``).  ``ingest`` cuts it
into windows of 64 characters labelled by the next character at each position
(train, val and test are the first 80%, the next 10% and the last 10% of the
text), once::

    python -m mpidist ingest lee-text lee-text.h5
    mpiexec -n 2 python examples/char_lm.py --data lee-text.h5

(without ``--data`` the script ingests it into a temporary file itself).  The
model predicts every position's next character; its validation loss is the
mean over the val split's characters, reported in nats and in bits per
character.  Then the chief writes a few lines of text of its own.
"""

import argparse
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np

import mpidist
from mpidist import data as datasets
from mpidist import nn


def build(sample_shape, vocab, dim=64, layers=2, heads=4):
    """Ids ``(L,)`` -> logits ``(L, vocab)``: position ``t`` sees characters ``0..t`` only (causal
    attention)."""
    return (
        [nn.Embedding(vocab, dim), nn.PositionalEmbedding(sample_shape[0])]
        + [nn.TransformerBlock(heads, causal=True) for _ in range(layers)]
        + [nn.LayerNorm(), nn.Dense(vocab, init="glorot")]
    )


def generate(model, names, prompt, length, temperature=0.8, seed=0):
    """``prompt`` continued by ``length`` characters, each drawn from the model's softmax /
    ``temperature``."""
    chars = [{"space": " ", "U+000A": "\n"}.get(name, name) for name in names]
    code = {char: index for index, char in enumerate(chars)}
    ids = [code[char] for char in prompt if char in code]
    rng, window = np.random.default_rng(seed), model.input_shape[0]
    for _ in range(length):
        logits = np.asarray(model.forward(np.array([ids[-window:]], dtype=np.float64)))[0, -1]
        weights = np.exp((logits - logits.max()) / temperature)
        ids.append(int(rng.choice(len(weights), p=weights / weights.sum())))
    return "".join(chars[i] for i in ids)


def dataset(path):
    """``(path, folder to remove at the end)``: ``path``, or else ``lee-text`` ingested into a temporary
    folder (by rank 0, for every rank)."""
    if path:
        return path, None
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    folder = world.bcast(tempfile.mkdtemp(prefix="char_lm-") if world.Get_rank() == 0 else None)
    target = Path(folder) / "lee-text.h5"
    if world.Get_rank() == 0:
        from mpidist.tools.ingest import ingest

        ingest("lee-text", target)
    world.Barrier()
    return str(target), folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="", help="lee-text.h5 as `python -m mpidist ingest lee-text` writes it"
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the epochs)")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--eval-samples", type=int, default=0, help="windows evaluated per split (0: all)")
    parser.add_argument("--generate", type=int, default=200, help="characters the chief writes at the end")
    args = parser.parse_args()

    def model(sample_shape, vocab):
        return build(sample_shape, vocab, dim=args.dim, layers=args.layers)

    data, scratch = dataset(args.data)
    result = mpidist.train(
        model,
        data,
        epochs=args.epochs,
        steps=args.steps,
        lr=args.lr,
        batch_size=64,
        lr_schedule="cosine",
        warmup_steps=100 if args.steps == 0 or args.steps > 200 else 0,
        eval_samples=args.eval_samples,
        progress="none",
        metrics="",
    )
    if result.is_chief:
        figures = result.figures
        val = figures["val_loss"]
        print(
            f"char_lm: {figures['steps']} steps, val loss {val:.4f} nats/char ({val / math.log(2):.4f} "
            "bits/char), "
            f"test loss {figures['test_loss']:.4f} nats/char, test accuracy {100 * result.test_accuracy:.2f}%"
        )
        if args.generate:
            print(generate(result.model, datasets.inspect(data).class_names, "The ", args.generate))
        if scratch:
            shutil.rmtree(scratch)
