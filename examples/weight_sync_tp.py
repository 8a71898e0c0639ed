"""Weight sync from a trainer to two tensor-parallel "engines", loaded as it streams.

What it shows:
- a trainer holds a state dict named and shaped like a small Llama (HF names:
  ``model.layers.N.self_attn.q_proj.weight``, ...; bf16, a few hundred MiB);
- two engines of two tensor-parallel ranks each hold their weights the way an inference
  engine does: fused (``qkv_proj`` = q, k and v stacked; ``gate_up_proj``), under their
  own names, each rank a slice (column-parallel weights split along dimension 0,
  row-parallel ones along dimension 1, the embeddings by vocabulary);
- after each update the trainer ``broadcast``s its state dict in buckets
  (``bucket_bytes``); every engine rank takes it as an iterator of ``(name, tensor)``
  (``into=rlcomm.Buckets(transform=...)``, the shape of vLLM's
  ``model.load_weights(weights)``, though vLLM's own loader wants whole, unfused
  tensors and slices them itself), asks for just its shards (``shards=``: only those
  bytes are read out of shared memory), and loads each tensor as soon as it is whole,
  while later buckets are still on their way; the transform renames and fuses;
- every rank checks every value it loaded against the trainer's (both make the weights
  from one seed), and reports the bytes it read.

Run it with ``python examples/weight_sync_tp.py [--quick]`` (``--quick``: a smaller
model and two syncs).
"""

from __future__ import annotations

import argparse
import re
import time

import torch

import rlcomm
from rlcomm import Cluster, NodePlacementStrategy, Shard, Worker

TRAINER, ENGINE_A, ENGINE_B = "trainer", "engine_a", "engine_b"
TP = 2
GROUPS = [(TRAINER, 0), (ENGINE_A, [0, 1]), (ENGINE_B, [0, 1])]
SRC = (TRAINER, 0)


def llama_shapes(hidden: int, ffn: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The trainer's parameter names and shapes (HF Llama, no biases, tied nothing)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),  # grouped-query: 4 q per kv
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def trainer_weights(shapes: dict[str, tuple[int, ...]], version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version`` (made from one seed: every rank can check)."""
    g = torch.Generator().manual_seed(1234)
    return {name: (torch.randn(shape, generator=g) + version).to(torch.bfloat16)
            for name, shape in shapes.items()}


# -- what an engine rank takes of each trainer tensor, and under which name -------------------

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def tp_shards(rank: int):
    """Column-parallel weights split along dimension 0, row-parallel along 1, norms whole."""
    def shard(name: str, shape: tuple[int, ...]) -> Shard | None:
        if any(f".{k}." in name or name.startswith(f"{k}.") for k in COLUMN):
            return Shard(0, rank, TP)
        if any(f".{k}." in name for k in ROW):
            return Shard(1, rank, TP)
        return None
    return shard


class Fuse:
    """The per-bucket transform: trainer names to engine names, q/k/v into qkv and
    gate/up into gate_up. A part whose siblings are in a later bucket waits here."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}

    FUSED = {"q": ("qkv_proj", ("q", "k", "v")), "k": ("qkv_proj", ("q", "k", "v")),
             "v": ("qkv_proj", ("q", "k", "v")), "gate": ("gate_up_proj", ("gate", "up")),
             "up": ("gate_up_proj", ("gate", "up"))}

    def __call__(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, t in pairs:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.weight", name)
            if m and m.group(2) in self.FUSED:
                fused, parts = self.FUSED[m.group(2)]
                key = f"layers.{m.group(1)}.{fused}.weight"
                have = self.waiting.setdefault(key, {})
                have[m.group(2)] = t
                if len(have) == len(parts):
                    out.append((key, torch.cat([have[p] for p in parts])))
                    del self.waiting[key]
                continue
            out.append((name.removeprefix("model.").replace("self_attn.", "attn.")
                        .replace("embed_tokens", "embed"), t))
        return out


def engine_param_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """An engine rank's parameters: fused, renamed, each its TP slice."""
    fuse, shard = Fuse(), tp_shards(0)
    taken = []
    for name, shape in shapes.items():
        s = shard(name, shape)
        taken.append((name, torch.empty(s.shape_of(shape, name) if s else shape,
                                        dtype=torch.bfloat16, device="meta")))
    return {name: tuple(t.shape) for name, t in fuse(taken)}


class Trainer(Worker):
    def __init__(self, dims: tuple[int, int, int, int]):
        super().__init__()
        self.shapes = llama_shapes(*dims)
        self.weights = trainer_weights(self.shapes, 0)

    def sync(self, version: int, bucket_mib: int) -> tuple[float, int]:
        """An "update" (the weights of ``version``, written in place), then the weight
        sync; seconds, bytes."""
        for name, t in trainer_weights(self.shapes, version).items():
            self.weights[name].copy_(t)
        start = time.perf_counter()
        self.broadcast(self.weights, groups=GROUPS, src=SRC, bucket_bytes=bucket_mib << 20)
        return time.perf_counter() - start, sum(t.numel() * 2 for t in self.weights.values())


class EngineRank(Worker):
    """One tensor-parallel rank of an inference engine."""

    def __init__(self, dims: tuple[int, int, int, int]):
        super().__init__()
        self.trainer_shapes = llama_shapes(*dims)
        self.params = {name: torch.zeros(shape, dtype=torch.bfloat16)
                       for name, shape in engine_param_shapes(self.trainer_shapes).items()}

    def load_weights(self, weights) -> tuple[int, int]:
        """What an engine's ``load_weights`` does: copy each weight into its parameter as
        it comes; returns how many it loaded, and from how many buckets."""
        loaded = 0
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            loaded += 1
        return loaded, weights.buckets_taken

    def sync(self, version: int) -> dict:
        before = _bytes_in()
        weights = self.broadcast(None, groups=GROUPS, src=SRC,
                                 into=rlcomm.Buckets(transform=Fuse()),
                                 shards=tp_shards(self.rank))
        loaded, buckets = self.load_weights(weights)
        return {"loaded": loaded, "buckets": buckets, "read": _bytes_in() - before,
                "checked": self.check(version)}

    def check(self, version: int) -> bool:
        """Every loaded value equals the trainer's, sliced and fused the engine's way."""
        want = dict(Fuse()([
            (name, t if (s := tp_shards(self.rank)(name, tuple(t.shape))) is None
             else t.chunk(s.parts, s.dim)[s.index])
            for name, t in trainer_weights(self.trainer_shapes, version).items()]))
        return set(want) == set(self.params) and all(
            torch.equal(self.params[k], want[k]) for k in want)


def _bytes_in() -> int:
    """The bytes this process read out of broadcasts so far (rlcomm's own count)."""
    from rlcomm.comm.status import process_status

    return sum(g["bytes_in"] for g in process_status()["process"]["broadcasts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, two syncs")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=None, help="default: 32 (--quick: 2)")
    args = parser.parse_args()
    bucket_mib = args.bucket_mib or (2 if args.quick else 32)
    # hidden, ffn, layers, vocab: about 300 MiB in bf16 (--quick: about 11 MiB)
    dims = (256, 704, 2, 8000) if args.quick else (1024, 2816, 8, 32000)
    syncs = 2 if args.quick else args.syncs
    cluster = Cluster(num_nodes=1)
    trainer = Trainer.create_group(dims).launch(cluster, name=TRAINER)
    engines = [EngineRank.create_group(dims).launch(cluster, NodePlacementStrategy([0, 0]),
                                                    name=name)
               for name in (ENGINE_A, ENGINE_B)]
    for version in range(1, syncs + 1):
        sent = trainer.sync(version, bucket_mib)
        taken = [engine.sync(version) for engine in engines]
        seconds, nbytes = sent.wait()[0]
        ranks = [r for result in taken for r in result.wait()]
        print(f"sync {version}: {nbytes / 2**20:.0f} MiB in {seconds:.2f} s; each engine rank "
              f"loaded {ranks[0]['loaded']} fused weights in {ranks[0]['buckets']} hand-offs, "
              f"read {[round(r['read'] / 2**20) for r in ranks]} MiB, values checked: "
              f"{all(r['checked'] for r in ranks)}")
        assert all(r["checked"] for r in ranks), ranks


if __name__ == "__main__":
    main()
