"""``python -m ashl.convert SCRIPT [OUT]``: a Horovod PyTorch script, converted to ashl by
changing three lines, as README's "Converting a Horovod script" does by hand:

    import horovod.torch as hvd                  ->  import horovod.torch as hvd, ashl.torch as ashl
    ... = ...DistributedSampler(dataset, ...)    ->  ... = ashl.HeterogeneousSampler(dataset, ...)
    ... = hvd.DistributedOptimizer(opt, ...)     ->  ... = ashl.DistributedOptimizer(opt, ..., sampler=S)

(S: the sampler converted on the second line). Every other line stays as it is: the epoch
loop, Horovod's keywords, ``hvd.allreduce`` of metrics. A script whose three lines do not have
these shapes (each on one line, each exactly once) is refused with the line that is missing.
"""
from __future__ import annotations

import re
import sys

__all__ = ["convert", "ConversionError"]

# A call on one line: its arguments (the shortest run that leaves only `)` and an optional
# comment after it), then any comment, which is kept.
_CALL_END = r"\((.*?),?[ \t]*\)([ \t]*#.*)?\r?$"
_IMPORT = re.compile(r"^([ \t]*)import horovod\.torch as hvd([ \t]*#.*)?\r?$", re.M)
_SAMPLER = re.compile(r"^([ \t]*)(\w+)[ \t]*=[ \t]*(?:torch\.utils\.data\.distributed\.)?"
                      r"DistributedSampler" + _CALL_END, re.M)
_OPTIMIZER = re.compile(r"^([ \t]*)(\w+)[ \t]*=[ \t]*hvd\.DistributedOptimizer" + _CALL_END, re.M)


class ConversionError(ValueError):
    pass


def _one(pattern: re.Pattern, text: str, what: str) -> re.Match:
    found = list(pattern.finditer(text))
    if len(found) > 1:    # a test-set sampler too: the training one is named so
        found = [m for m in found if "train" in m.group(2)] if pattern is _SAMPLER else found
    if len(found) != 1:
        raise ConversionError(f"expected exactly one line {what}, found {len(found)}")
    return found[0]


def convert(text: str) -> str:
    """The script `text` with its import, training sampler and optimizer wrapper converted."""
    imp = _one(_IMPORT, text, "`import horovod.torch as hvd`")
    sampler = _one(_SAMPLER, text, "`NAME = DistributedSampler(...)` for the training data")
    opt = _one(_OPTIMIZER, text, "`NAME = hvd.DistributedOptimizer(...)` on one line")
    tail = lambda m, i: m.group(i) or ""   # noqa: E731 - a kept comment
    edits = [
        (imp, f"{imp.group(1)}import horovod.torch as hvd, ashl.torch as ashl{tail(imp, 2)}"),
        (sampler, f"{sampler.group(1)}{sampler.group(2)} = "
                  f"ashl.HeterogeneousSampler({sampler.group(3)}){tail(sampler, 4)}"),
        (opt, f"{opt.group(1)}{opt.group(2)} = ashl.DistributedOptimizer("
              f"{opt.group(3)}, sampler={sampler.group(2)}){tail(opt, 4)}"),
    ]
    for match, line in sorted(edits, key=lambda e: -e[0].start()):
        text = text[:match.start()] + line + text[match.end():]
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m ashl.convert SCRIPT [OUT]", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            out = convert(f.read())
    except (OSError, ConversionError) as e:
        print(f"ashl.convert: {argv[0]}: {e}", file=sys.stderr)
        return 2
    if len(argv) == 2:
        with open(argv[1], "w") as f:
            f.write(out)
    else:
        sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
