"""A Hugging Face transformers model through raympi.fit: GPT-2 computes its own loss from the labels.

    python examples/transformers_gpt2.py                  # a small GPT-2 on a local text, 2 workers
    python examples/transformers_gpt2.py --precision bf16 --accumulate 2

No loss_fn is given: the batches are dicts of inputs (input_ids and labels), and raympi takes the
loss the model returns (outputs.loss), as a Hugging Face Trainer would.  The model is built from a
config, so nothing is downloaded; the text is a file on this machine (characters as tokens).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import raympi

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


class Windows(torch.utils.data.Dataset):
    """Windows of ``length`` characters of a text, as the dicts a tokenized Hugging Face dataset gives."""

    def __init__(self, ids: torch.Tensor, length: int, count: int, seed: int) -> None:
        self.ids, self.length = ids, length
        self.starts = torch.randint(0, len(ids) - length, (count,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[self.starts[i] : self.starts[i] + self.length]
        return {"input_ids": window, "labels": window}  # GPT-2 shifts the labels itself


def main(argv: list[str] | None = None) -> raympi.Result:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=DEFAULT_TEXT if sys.platform == "linux" else __file__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--checkpoint-dir", default="runs/gpt2")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)"
    )
    parser.add_argument(
        "--shard-optimizer", action="store_true", help="each worker keeps only its slice of the optimizer state"
    )
    args = parser.parse_args(argv)

    try:
        text = open(args.text, encoding="utf-8", errors="replace").read()
    except OSError as exc:
        sys.exit(f"transformers_gpt2.py: cannot read --text {args.text}: {exc}")
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    train = Windows(ids, args.context, 4096, seed=0)
    held_out = Windows(ids, args.context, 512, seed=1)

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(vocab), n_positions=args.context, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    # no weight decay on biases and LayerNorms, as usual for transformers
    decay = raympi.optim.masked(
        raympi.optim.add_decayed_weights(0.01), lambda params: {n: p.ndim >= 2 for n, p in params.items()}
    )
    start = time.time()
    result = raympi.fit(
        model,
        train,
        workers=args.workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        optimizer=raympi.optim.chain(raympi.optim.clip_by_global_norm(1.0), decay, raympi.optim.adam(3e-3)),
        eval_dataset=held_out,
        precision=args.precision,
        accumulate=args.accumulate,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        shard_optimizer=args.shard_optimizer,
    )
    first, last = result.metrics[0], result.metrics[-1]
    print(
        f"GPT-2 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(vocab)} characters): "
        f"loss {first['loss']:.3f} -> {last['loss']:.3f}, held-out loss {last['eval_loss']:.3f} "
        f"after {len(result.metrics)} steps, {time.time() - start:.1f} s"
    )
    prompt = torch.tensor([[vocab.index(c) for c in "the "]])
    sample = result.model.eval().generate(prompt, max_new_tokens=60, do_sample=False, pad_token_id=0)
    print("sample:", repr("".join(vocab[i] for i in sample[0].tolist())))
    return result


if __name__ == "__main__":
    main()
