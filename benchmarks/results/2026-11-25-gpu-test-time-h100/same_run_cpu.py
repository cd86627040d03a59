"""Same-run comparison (one process, one machine, alternating): how test workers start."""
import os, sys, time, tempfile
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch.multiprocessing as mp
import tests.support.helpers as h
import tests.gpu.test_cuda_graphs as g

CPU = ["data=gpt_mock", "model.vocab_size=512", "distributed=fsdp2", "model.backend=torch", "training.micro_batch_size=8",
       "training.global_batch_size=16", *g.EVERY_STEP, "data.num_workers=2"]
g.CASES["cpu"] = ("gpt_sanity", CPU)

def run_with(ctx_name, world, fn, *args):
    ctx = mp.get_context(ctx_name)
    if ctx_name == "forkserver":
        ctx.set_forkserver_preload(h.FORK_SERVER_PRELOAD)
    with ctx.Manager() as manager:
        results = manager.dict(); port = h.free_port()
        procs = [ctx.Process(target=h._worker, args=(r, world, port, fn, args, results, dict(os.environ), os.getcwd())) for r in range(world)]
        [p.start() for p in procs]; [p.join() for p in procs]
        return [results[r] for r in range(world)]

def noop():
    return 1

def phases_with_loader(method, phases):
    mp.set_start_method(method, force=True)  # after _worker's "fork": the loaders' start method under test
    return g._phases(phases)

if __name__ == "__main__":
    for rep in range(2):
        for ctx_name in ("spawn", "forkserver"):
            t = time.time(); run_with(ctx_name, 2, noop); print(f"run_workers start, 2 procs, {ctx_name}: {time.time()-t:.2f} s", flush=True)
    for rep in range(2):
        for method in ("spawn", "fork"):
            d = tempfile.mkdtemp()
            phases = [g._run(d, "cpu", "eager", ["training.steps=12"]), g._run(d, "cpu", "job", ["training.steps=12"], signal_at=5),
                      g._run(d, "cpu", "job", ["training.steps=12"])]
            t = time.time(); out = run_with("forkserver", 1, phases_with_loader, method, phases)
            assert out[0][0] == "ok", out[0][1]
            print(f"3 training phases (gpt_sanity, 2 loader workers), loaders by {method}: {time.time()-t:.2f} s", flush=True)
