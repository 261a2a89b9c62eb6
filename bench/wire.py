"""Wire-format throughput: encode + sign + verify + decode of a ResNet-18-sized
state dict, plain and encrypted, against a bytes copy and one SHA-256 pass over
the same bytes, measured in the same run.

    python -m bench.wire [--repeats 5] [--mb 46.8]

The round trip includes writing the frame into one receive buffer (what a
socket read does), so it is an honest end-to-end figure, not just the codec.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch

from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec


def resnet18_like_state_dict(total_mb: float) -> dict[str, torch.Tensor]:
    """Tensors shaped like ResNet-18's (conv stacks + fc), scaled to total_mb."""
    shapes = [(64, 3, 7, 7), (64,), (64,), (64,), (64,)]
    for cin, cout in ((64, 64), (64, 128), (128, 256), (256, 512)):
        for block in range(2):
            c_in = cin if block == 0 else cout
            shapes += [
                (cout, c_in, 3, 3),
                (cout,),
                (cout,),
                (cout,),
                (cout,),
                (cout, cout, 3, 3),
                (cout,),
                (cout,),
                (cout,),
                (cout,),
            ]
    shapes += [(1000, 512), (1000,)]
    sd = {f"t{i}": torch.randn(s) for i, s in enumerate(shapes)}
    have = sum(t.numel() * 4 for t in sd.values())
    missing = int(total_mb * 1e6) - have
    if missing > 0:
        sd["pad"] = torch.randn(missing // 4)
    return sd


def receive(chunks) -> bytearray:
    buf = bytearray(sum(len(c) for c in chunks))
    view = memoryview(buf)
    pos = 0
    for c in chunks:
        view[pos : pos + len(c)] = c
        pos += len(c)
    return buf


def best_rate(fn, nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / 1e6 / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mb", type=float, default=46.8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    sd = resnet18_like_state_dict(args.mb)
    flat = b"".join(t.numpy().tobytes() for t in sd.values())
    nbytes = len(flat)
    alice, bob = LocalIdentity.generate("alice"), LocalIdentity.generate("bob")
    roster = Roster([alice.card("127.0.0.1:1"), bob.card("127.0.0.1:2")])
    sender = WireCodec(alice, roster, "bench")
    receiver = WireCodec(bob, roster, "bench", max_message_bytes=1 << 30)

    def roundtrip(encrypt: bool) -> None:
        msg = sender.encode("model", "bob", {"state": sd}, round=1, encrypt=encrypt)
        got = receiver.decode(receive(msg.chunks), require_finite=True)
        assert torch.equal(got.payload["state"]["t0"], sd["t0"])

    roundtrip(False)  # warm-up (page faults, key derivation caches)
    memcpy = best_rate(lambda: bytearray(flat), nbytes, args.repeats)
    sha = best_rate(lambda: hashlib.sha256(flat).digest(), nbytes, args.repeats)
    plain = best_rate(lambda: roundtrip(False), nbytes, args.repeats)
    sealed = best_rate(lambda: roundtrip(True), nbytes, args.repeats)
    result = {
        "payload_mb": round(nbytes / 1e6, 2),
        "tensors": len(sd),
        "repeats": args.repeats,
        "memcpy_mb_s": round(memcpy, 1),
        "sha256_mb_s": round(sha, 1),
        "roundtrip_mb_s": round(plain, 1),
        "encrypted_roundtrip_mb_s": round(sealed, 1),
        "ratio_vs_memcpy": round(plain / memcpy, 3),
        "ratio_vs_sha256": round(plain / sha, 3),
        "encrypted_ratio_vs_memcpy": round(sealed / memcpy, 3),
    }
    print(
        f"payload {result['payload_mb']} MB: memcpy {memcpy:.0f} MB/s, sha256 {sha:.0f} MB/s, "
        f"signed round trip {plain:.0f} MB/s, encrypted {sealed:.0f} MB/s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
