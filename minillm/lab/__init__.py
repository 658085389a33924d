"""The course's lab equipment: simulators, workloads, traces, replays, drawings and plots that the
lectures use to look at the engine. None of it is how an inference engine works; all of it is how
the course watches one work.

    workloads.py         seeded request length mixes (ShareGPT-, Alpaca-like), ch. 02-03, 08
    arena.py             ContiguousArena / Slab: one KV tensor carved into max-length slabs, ch. 02
    memory_sim.py        simulate_arena / simulate_blocks / MemoryTrace / plot_memory_map, ch. 02-03
    viz.py               block-table drawings, step timelines, widget controls, ch. 01-05
    step_trace.py        run_trace / describe: record an engine's steps; replay_schedule: the
                         scheduler without a model on a modelled clock, ch. 04-05
    prefix_workloads.py  shared-prefix and multi-turn prompts with a known hit rate, ch. 06
    radix.py             RadixCache: SGLang's radix tree, the lecture's comparison, ch. 06
    prefix_sim.py        replay_hash_chain / replay_radix -> PrefixReplayResult, ch. 06
    serving_replay.py    replay_serving: the real engine on a virtual clock -> ServingReplayResult,
                         ch. 08
    capacity.py          Little's law, cost per token, step memory, ch. 08 (and the drill)
    profiling.py         decode_engine / profile_steps / op_table: GEMM vs other time per step,
                         ch. 12
    overlap.py           run_serial / run_overlapped / compare: host work of step N+1 during
                         step N's compute, with a thread, ch. 12

Layer rule (tests/test_layers.py): the lab imports the engine (model, cache, kernels, engine,
spec, serve, ...), never the reverse, and never grading or drill; grading and drill may import
the lab. This file imports nothing, so `import minillm.lab.capacity` stays light.
"""
