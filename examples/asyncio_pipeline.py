"""An asyncio pipeline on three worker groups: generator -> scorer -> sink.

What it shows:
- stages written with ``async def``, running under uvloop inside each worker;
- channels between the stages: ``await channel.aput(...)`` in the producer,
  ``async for item in channel.stream()`` in the consumers;
- a tensor sent point-to-point with ``send(..., async_op=True)`` and awaited with
  ``AsyncWork.async_wait()`` (the generator hands each scorer its scoring weights);
- backpressure: the channels are bounded and the sink is slow on purpose, so the
  generator is held to the sink's pace instead of growing the queues.

Prints per-stage throughput, end-to-end latency percentiles and the deepest queue seen.
Run: ``python examples/asyncio_pipeline.py [--items 400] [--sink-delay-ms 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import torch

from rlcomm import Channel, Cluster, NodePlacementStrategy, Worker

GEN, SCORER, SINK = "pipe_generator", "pipe_scorer", "pipe_sink"


@dataclass
class Prompt:
    id: int
    created: float
    features: torch.Tensor  # (64,)


@dataclass
class Scored:
    id: int
    created: float
    score: torch.Tensor  # 0-d
    scorer: int


def _run(coro):
    import uvloop

    return uvloop.run(coro)


class Generator(Worker):
    def run(self, items: int, num_scorers: int, dim: int) -> dict:
        async def main() -> dict:
            # Each scorer gets its weights point-to-point; await the async sends.
            weights = torch.randn(dim)
            sends = [self.send(weights * (r + 1), SCORER, r, async_op=True)
                     for r in range(num_scorers)]
            for work in sends:
                await work.async_wait()
            # Connecting and qsize() block (Ray calls, a round trip): off the loop.
            out = await asyncio.to_thread(self.connect_channel, "pipe_prompts")
            start, deepest = time.monotonic(), 0
            for i in range(items):
                await out.aput(Prompt(i, time.time(), torch.randn(dim)))
                if i % 16 == 0:
                    deepest = max(deepest, await asyncio.to_thread(out.qsize))
            elapsed = time.monotonic() - start
            await out.aclose()  # the scorers' streams end once they drained it
            return {"stage": "generator", "items": items, "seconds": elapsed,
                    "deepest_queue": deepest, "loop": type(_loop()).__module__}

        return _run(main())


def _loop():
    import asyncio

    return asyncio.get_running_loop()


class Scorer(Worker):
    def run(self) -> dict:
        async def main() -> dict:
            weights = await self.recv(GEN, 0, async_op=True).async_wait()
            source = await asyncio.to_thread(self.connect_channel, "pipe_prompts")
            sink = await asyncio.to_thread(self.connect_channel, "pipe_scored")
            n, start = 0, time.monotonic()
            async for prompt in source.stream():
                score = torch.tanh(prompt.features @ weights)
                await sink.aput(Scored(prompt.id, prompt.created, score, self._rank))
                n += 1
            return {"stage": f"scorer {self._rank}", "items": n,
                    "seconds": time.monotonic() - start}

        return _run(main())


class Sink(Worker):
    def run(self, delay_s: float) -> dict:
        async def main() -> dict:
            source = await asyncio.to_thread(self.connect_channel, "pipe_scored")
            latencies, n, start, deepest = [], 0, time.monotonic(), 0
            async for item in source.stream():
                await asyncio.sleep(delay_s)  # a slow consumer
                latencies.append(time.time() - item.created)
                if n % 16 == 0:
                    deepest = max(deepest, await asyncio.to_thread(source.qsize))
                n += 1
            return {"stage": "sink", "items": n, "seconds": time.monotonic() - start,
                    "latencies": latencies, "deepest_queue": deepest}

        return _run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--scorers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--maxsize", type=int, default=16, help="bound of each channel")
    parser.add_argument("--sink-delay-ms", type=float, default=2.0)
    args = parser.parse_args()

    cluster = Cluster(num_nodes=1)
    prompts = Channel.create("pipe_prompts", maxsize=args.maxsize, item_type=Prompt)
    scored = Channel.create("pipe_scored", maxsize=args.maxsize, item_type=Scored)
    gen = Generator.create_group().launch(cluster, name=GEN)
    scorers = Scorer.create_group().launch(
        cluster, NodePlacementStrategy([0] * args.scorers), name=SCORER
    )
    sink = Sink.create_group().launch(cluster, name=SINK)
    try:
        h_sink = sink.run(args.sink_delay_ms / 1000)
        h_scorers = scorers.run()
        h_gen = gen.run(args.items, args.scorers, args.dim)
        g = h_gen.wait(timeout=600)[0]
        s = h_scorers.wait(timeout=600)
        scored.close()  # every scorer is done: let the sink's stream end
        k = h_sink.wait(timeout=600)[0]
    finally:
        for group in (gen, scorers, sink):
            group.shutdown()
        prompts.close()
        scored.close()

    print(f"\nPipeline: 1 generator -> {args.scorers} scorers -> 1 sink, {args.items} items, "
          f"channels bounded at {args.maxsize}, sink delay {args.sink_delay_ms} ms, "
          f"event loop: {g['loop']}")
    print(f"{'stage':12s}{'items':>8s}{'seconds':>10s}{'items/s':>10s}")
    for r in [g, *s, k]:
        print(f"{r['stage']:12s}{r['items']:>8d}{r['seconds']:>10.2f}{r['items'] / r['seconds']:>10.0f}")
    lat = sorted(k["latencies"])
    pct = {p: lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1e3 for p in (50, 90, 99)}
    print(f"end-to-end latency: p50 {pct[50]:.1f} ms, p90 {pct[90]:.1f} ms, p99 {pct[99]:.1f} ms, "
          f"mean {statistics.mean(lat) * 1e3:.1f} ms")
    sink_rate = k["items"] / k["seconds"]
    gen_rate = g["items"] / g["seconds"]
    print(f"backpressure: generator put {gen_rate:.0f} items/s, sink drained {sink_rate:.0f} "
          f"items/s (ceiling {1000 / args.sink_delay_ms:.0f}/s); deepest queue seen: "
          f"prompts {g['deepest_queue']}, scored {k['deepest_queue']} (bound {args.maxsize})")
    assert k["items"] == args.items == sum(r["items"] for r in s), "items lost or duplicated"
    print("all items arrived exactly once")


if __name__ == "__main__":
    main()
