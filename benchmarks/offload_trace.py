"""What an offloaded training step holds, event by event: one offload probe (`memory_probe --offload_probes`'s
placements) with the `OffloadActivations` context of its last step written down at every layer boundary in forward
("B") and every unpack in backward ("U"): the key, how many saved tensors are on their way to the host, fetched back
ahead of use and stored on the host, and on CUDA the allocated and peak device GiB since the step began.

    python3 -m benchmarks.offload_trace --preset recurrent-3.3b --batch_size 2 --output trace.json [--eager]
    python3 -m benchmarks.offload_trace --preset debug --device cpu --seq_len 32 --min_bytes 1024 --output t.json

The summary gives the offloaded tensors of the largest layer application and the most tensors fetched ahead at once:
backward should hold the rest of the application in use and the one before it, no more. A trace of 2026-12-06 on an
H100 (results/gpu-2026-12-06b/h100/diag) found 106 fetched ahead half-way through a recurrent-3.3b step's backward.
"""

import argparse
import contextlib
import json
import sys
import tempfile

from benchmarks import memory_probe
from trainer_ext.memory import offload


@contextlib.contextmanager
def traced(events: list, moved: dict, min_bytes: int = offload.MIN_OFFLOAD_BYTES):
    """Record the context's state into `events` (cleared at each forward) and whether each packed key went to the
    host into `moved`, while inside; saved tensors under `min_bytes` stay on the device."""
    import torch

    cuda = torch.cuda.is_available()

    def memory():
        return (round(torch.cuda.memory_allocated() / 2**30, 3), round(torch.cuda.max_memory_allocated() / 2**30, 3)) \
            if cuda else (None, None)

    def state(context, kind, key):
        events.append((kind, key, len(context._leaving), len(context._fetched), len(context._stored), *memory()))

    originals = {name: getattr(offload.OffloadActivations, name) for name in ("layer_boundary", "_pack", "_unpack")}
    renew = offload.OffloadedForward.renew

    def new_step(self, *args):
        self.min_bytes = min_bytes
        events.clear()
        moved.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        return renew(self, *args)

    def boundary(self):
        originals["layer_boundary"](self)
        state(self, "B", self._next_key)

    def pack(self, tensor):
        key = originals["_pack"](self, tensor)
        moved[key] = self._stored[key][0] != "kept"
        return key

    def unpack(self, key):
        tensor = originals["_unpack"](self, key)
        state(self, "U", key)
        return tensor

    patches = {"layer_boundary": boundary, "_pack": pack, "_unpack": unpack}
    try:
        offload.OffloadedForward.renew = new_step
        for name, function in patches.items():
            setattr(offload.OffloadActivations, name, function)
        yield
    finally:
        offload.OffloadedForward.renew = renew
        for name, function in originals.items():
            setattr(offload.OffloadActivations, name, function)


def summary(events: list, moved: dict) -> dict:
    starts = [event[1] for event in events if event[0] == "B"]
    ends = starts[1:] + [max(moved, default=-1) + 1]
    per_application = [sum(moved.get(key, False) for key in range(a, b)) for a, b in zip(starts, ends)]
    unpacks = [event for event in events if event[0] == "U"]
    peaks = [event[-1] for event in events if event[-1] is not None]
    return {"applications": len(starts), "offloaded_tensors": sum(moved.values()), "saved_tensors": len(moved),
            "largest_application": max(per_application, default=0), "unpacks": len(unpacks),
            "most_fetched_ahead": max((event[3] for event in unpacks), default=0),
            "fetched_at_the_end": unpacks[-1][3] if unpacks else None, "peak_allocated_gib": max(peaks, default=None)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="recurrent-3.3b")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--placement", choices=("offload_unique", "offload_all"), default="offload_unique")
    parser.add_argument("--eager", action="store_true", help="Without torch.compile.")
    parser.add_argument("--steps", type=int, default=4, help="Steps; the last one is traced.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--min_bytes", type=int, default=offload.MIN_OFFLOAD_BYTES,
                        help="Saved tensors smaller than this stay on the device (the training default).")
    parser.add_argument("--output", required=True, help="JSON file: the spec, the probe's status, events, summary.")
    args = parser.parse_args(argv)
    compiled = not args.eager
    spec = next(s for s in memory_probe.offload_grid(args.preset, args.seq_len, (compiled,))
                if s["recompute"] == args.placement)
    spec = {**spec, "batch_size": args.batch_size}
    events, moved = [], {}
    with traced(events, moved, args.min_bytes):
        model = memory_probe._build(args.preset, args.device)
        with tempfile.TemporaryDirectory() as output_dir:
            record = memory_probe.run_probe(model, spec, args.steps, args.device, output_dir)
    result = {"spec": spec, "status": record["status"], "error": record.get("error"),
              "step_seconds": record["step_seconds"], "summary": summary(events, moved), "events": events}
    with open(args.output, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: result[k] for k in ("status", "error", "summary")}))
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
