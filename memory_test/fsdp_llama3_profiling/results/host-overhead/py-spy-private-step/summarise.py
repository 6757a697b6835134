"""Shares of a step's py-spy samples: ``summarise.py private.gz non_private.gz`` (collapsed).

Prints each function's cumulative share of the samples inside ``_step`` (private, then
non-private), then, for the private step, the share whose innermost frame of this package is
each function (``-``: no frame of ours, e.g. autograd's engine or FSDP2).
"""

import collections
import gzip
import re
import sys


def load(path):
    """``[(frames, count)]`` of a py-spy raw (collapsed) file."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.strip():
                stack, count = line.rstrip().rsplit(" ", 1)
                out.append((stack.split(";"), int(count)))
    return out


def name(frame):
    """``function (file)`` of a frame, without line numbers or the install prefix."""
    m = re.match(r"(.*) \((.*?):\d+\)", frame)
    if not m:
        return frame
    return f"{m.group(1)} ({m.group(2).split('site-packages/')[-1].split('/work/main/')[-1]})"


def in_step(frames):
    """Whether a sample is inside a step."""
    return any("_step (opacus_fsdp_sync/bench/ledger.py" in f for f in frames)


def cumulative(stacks):
    """Samples inside a step with each function on the stack, and all samples in a step."""
    counts, total = collections.Counter(), 0
    for frames, n in stacks:
        if in_step(frames):
            total += n
            for key in {name(f) for f in frames}:
                counts[key] += n
    return counts, total


def main():
    """Prints both tables."""
    private, plain = load(sys.argv[1]), load(sys.argv[2])
    (a, ta), (b, tb) = cumulative(private), cumulative(plain)
    print(f"samples in a step: private {ta}, non-private {tb}")
    for key, n in a.most_common(60):
        print(f"{n / ta * 100:6.1f}% {b.get(key, 0) / tb * 100:6.1f}%  {key[:150]}")
    inner, total = collections.Counter(), 0
    for frames, n in private:
        if in_step(frames):
            total += n
            ours = [f for f in frames if "opacus_fsdp_sync/" in f and "bench/" not in f]
            inner[name(ours[-1]) if ours else "-"] += n
    print("\ninnermost frame of ours, private step:")
    for key, n in inner.most_common(45):
        print(f"{n / total * 100:5.1f}%  {key[:140]}")


if __name__ == "__main__":
    main()
