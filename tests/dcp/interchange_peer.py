"""The Python side of dcp's interchange tests, run by Debian's python3-torch.

  interchange_peer.py torch-write OUT        torch.save of the closed-form dict
                                             (OUT, and OUT.legacy in the old format)
  interchange_peer.py st-write OUT           safetensors.torch.save_file of it
  interchange_peer.py torch-read IN DIR      torch.load(IN, weights_only=True): each
  interchange_peer.py st-read IN DIR         tensor's bytes to DIR/<name>.bin, and
                                             DIR/manifest.txt: name dtype shape per line
  interchange_peer.py --probe-safetensors    exits 77 when safetensors is absent

The closed-form dict is the one tests/dcp/python_interchange_test.cpp builds.
"""
import os
import sys

import torch


def closed_form(contiguous_only):
    d = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.5,
        "b": torch.arange(5, dtype=torch.bfloat16) * 0.25,
        "h": torch.arange(4, dtype=torch.float16) * 0.5,
        "d": torch.tensor(2.5, dtype=torch.float64),
        "i": torch.arange(-3, 3, dtype=torch.int64) * 1000000000000,
        "k": torch.arange(6, dtype=torch.int32).reshape(1, 2, 3) - 2,
        "m": torch.tensor([True, False, True]),
        "e": torch.zeros(0, 3),
    }
    if not contiguous_only:
        # A transposed view: torch.save keeps its storage and strides.
        d["t"] = (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1).t()
    return d


def dump(tensors, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "manifest.txt"), "w") as manifest:
        for name, t in tensors.items():
            shape = ",".join(str(s) for s in t.shape)
            manifest.write(f"{name} {str(t.dtype).replace('torch.', '')} [{shape}]\n")
            raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0)
            with open(os.path.join(out_dir, name + ".bin"), "wb") as f:
                f.write(bytes(raw.tolist()))


def main():
    cmd = sys.argv[1]
    if cmd == "--probe-safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            print("this Python has no safetensors module (python3-safetensors)")
            sys.exit(77)
    elif cmd == "torch-write":
        torch.save(closed_form(False), sys.argv[2])
        torch.save(closed_form(False), sys.argv[2] + ".legacy",
                   _use_new_zipfile_serialization=False)
    elif cmd == "st-write":
        import safetensors.torch
        safetensors.torch.save_file(closed_form(True), sys.argv[2], metadata={"by": "python"})
    elif cmd == "torch-read":
        dump(torch.load(sys.argv[2], weights_only=True), sys.argv[3])
    elif cmd == "st-read":
        import safetensors.torch
        dump(safetensors.torch.load_file(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("unknown command " + cmd)


if __name__ == "__main__":
    main()
