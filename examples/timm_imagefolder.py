"""A timm model on an ImageFolder of PNG files, with torchvision's random transforms, through raympi.fit.

    python examples/timm_imagefolder.py                       # resnet18, 4,000 Fashion-MNIST PNGs, 2 workers
    python examples/timm_imagefolder.py --samples 20000 --model resnet34

The first run writes the images once (data/fashion-png/{train,test}/<class>/<n>.png, from Debian's
dataset-fashion-mnist); after that the example is what it would be on your own folder of images:
torchvision.datasets.ImageFolder with RandomCrop and RandomHorizontalFlip, read and augmented afresh
every epoch on the workers, and a timm model as it comes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


import raympi

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist  # noqa: E402  (the Fashion-MNIST reader, beside this file)


def write_pngs(folder: str, data_dir: str, samples: int) -> None:
    """Fashion-MNIST as PNG files in ImageFolder's layout (once: skipped when the folder is complete)."""
    from PIL import Image

    for split, count in (("train", samples), ("test", max(1, samples // 5))):
        done = os.path.join(folder, split, f".complete-{count}")
        if os.path.exists(done):
            continue
        ds = mnist._torchvision("fashion-mnist", data_dir, train=split == "train")
        for i in range(count):
            label = int(ds.targets[i])
            os.makedirs(os.path.join(folder, split, ds.classes[label].replace("/", "-")), exist_ok=True)
            path = os.path.join(folder, split, ds.classes[label].replace("/", "-"), f"{i:05d}.png")
            Image.fromarray(ds.data[i].numpy()).save(path)
        open(done, "w").close()


def main(argv: list[str] | None = None) -> raympi.Result:
    import timm
    from torchvision import datasets, transforms

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="any timm model name")
    parser.add_argument("--samples", type=int, default=4000, help="training images (test: a fifth of it)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--checkpoint-dir", default="runs/timm")
    args = parser.parse_args(argv)

    folder = os.path.join(args.data_dir, "fashion-png")
    write_pngs(folder, args.data_dir, args.samples)
    normalize = transforms.Normalize((0.2860,), (0.3530,))
    train = datasets.ImageFolder(
        os.path.join(folder, "train"),
        transform=transforms.Compose(
            [
                transforms.Grayscale(),
                transforms.RandomCrop(28, padding=2),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        ),
    )
    test = datasets.ImageFolder(
        os.path.join(folder, "test"),
        transform=transforms.Compose([transforms.Grayscale(), transforms.ToTensor(), normalize]),
    )
    model = timm.create_model(args.model, pretrained=False, num_classes=len(train.classes), in_chans=1)
    start = time.time()
    result = raympi.fit(
        model,
        train,
        workers=args.workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        optimizer=raympi.optim.adamw(1e-3, weight_decay=0.05),
        eval_dataset=test,
        checkpoint_dir=args.checkpoint_dir,
    )
    last = result.metrics[-1]
    steady = sorted(r["samples_per_s"] for r in result.metrics[len(result.metrics) // 2 :])
    print(
        f"timm {args.model} on {len(train)} PNGs: eval accuracy {last['eval_accuracy']:.3f} after {args.epochs} "
        f"epoch(s), {steady[len(steady) // 2]:.0f} samples/s steady, {time.time() - start:.1f} s"
    )
    return result


if __name__ == "__main__":
    main()
