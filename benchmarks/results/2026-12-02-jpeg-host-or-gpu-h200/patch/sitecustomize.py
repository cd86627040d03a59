"""Probe-only patches for an A/B inside training (not the product): put this folder on PYTHONPATH and name the
patches in JPEG_PATCH (comma-separated):
  trainprio     the training process's main thread works on a high-priority stream from the start, so the step's
                kernels go before the decoder's when both wait for the SMs (a GPU-side contention test)
  switch=S      sys.setswitchinterval(S): how long a thread running Python keeps the GIL while another waits for it
                (Python's default 0.005 s; a host-side contention test)
  replaytimes   CUDA events around every CUDA-graph replay; at the end, appended to $REPLAY_TIMES_FILE: the GPU time
                of the second half's replays and the time between one replay's end and the next one's start (the
                step's other work, or an idle GPU), with the run's data overrides
  nodecode      recipes/vit/jpeg.py reads each file's header as it does, then hands back uninitialised images of the
                header's size instead of decoding (no nvImageCodec decode: neither its host nor its GPU work); the
                crop kernel and the rest of the loop run as they do (a timing probe: the images are garbage)
  poolkeep      the GPU's default memory pool (where nvImageCodec's cudaMallocAsync allocates) keeps the memory freed
                into it: its release threshold 0 returns it to the driver at every event or stream synchronize, and
                the decoder allocates, frees and synchronizes per image (a GPU-wide mapping cost, perhaps)
  dali          training batches decoded, cropped, resized, flipped and normalized by a DALI pipeline instead
                (NVIDIA DALI: batched hardware decode, device="mixed" on a GPU, "cpu" elsewhere; the crops the
                workers drew; validation batches as before); the pixels follow DALI's decoder and resize, not
                PIL's (a timing probe)
  gctime        every garbage collection of the run timed (gc.callbacks); at the end, appended to $REPLAY_TIMES_FILE:
                the count and total time per generation and the collections over 20 ms
  gcfreeze      at the first graph replay (setup done): gc.collect() then gc.freeze(), so later collections no
                longer walk the objects that setup made (the imported libraries, the model, the configs)
  nogcfreeze    the training loop without its gc.freeze() of what setup built (core/training/garbage_collection.py):
                the loop as it was before it
  gcoff         automatic garbage collection off for the whole run (gc.disable(): an upper bound, not a setting)
  dalihw=X      data.device_decoder=dali (the product, recipes/vit/dali_crops.py) with hw_decoder_load=X: the share
                of the images sent to the hardware JPEG engines (DALI's default 0.65; the rest to the CUDA decoder)
  dalithreads=N data.device_decoder=dali with N host threads in its pipeline (recipes/vit/dali_crops.CPU_THREADS)
  daliload=X    with dali: the decoder's hw_decoder_load (the share of the images sent to the hardware JPEG engines,
                the rest to the CUDA decoder on the SMs; DALI's default 0.65)"""

import os
import sys

_PATCHES = [p for p in os.environ.get("JPEG_PATCH", "").split(",") if p]
_DALI_LOAD = [float(p.split("=")[1]) for p in _PATCHES if p.startswith("daliload=")]
if _PATCHES:
    import torch

    for _p in _PATCHES:
        if _p == "trainprio":
            import core.distributed.env as E

            def _setup(*args, _real=E.setup, **kwargs):
                env = _real(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.set_stream(torch.cuda.Stream(priority=-1))
                return env

            E.setup = _setup
        elif _p.startswith("switch="):
            sys.setswitchinterval(float(_p.split("=")[1]))
        elif _p == "replaytimes":
            import statistics

            import core.distributed.launch as L

            _marks = []
            _replay = torch.cuda.CUDAGraph.replay

            import time

            _host = []

            def _timed_replay(self, _replay=_replay):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _host.append(time.perf_counter())
                start.record()
                _replay(self)
                end.record()
                _marks.append((start, end))

            torch.cuda.CUDAGraph.replay = _timed_replay

            def _report():
                data = " ".join(a for a in sys.argv[1:] if a.startswith("data"))
                out = os.environ.get("REPLAY_TIMES_FILE", "/tmp/replay_times.txt")
                if len(_marks) < 4:
                    with open(out, "a") as f:
                        f.write(f"{data}: {len(_marks)} replays\n")
                    return
                torch.cuda.synchronize()
                half = _marks[len(_marks) // 2 :]
                busy = [s.elapsed_time(e) for s, e in half]
                between = [a[1].elapsed_time(b[0]) for a, b in zip(half, half[1:])]
                host = _host[len(_marks) // 2 :]
                host_between = [1000 * (b - a) for a, b in zip(host, host[1:])]
                worst = max(range(len(between)), key=between.__getitem__)
                with open(out, "a") as f:
                    f.write(
                        f"{data}: longest GPU gap after replay {worst + 1} of {len(half)}; host ms between those two "
                        f"replay calls {host_between[worst]:.2f} "
                        f"(median host ms {statistics.median(host_between):.2f})\n"
                    )
                    f.write(
                        f"{data}: {len(half)} replays, GPU ms per replay median {statistics.median(busy):.2f} "
                        f"mean {statistics.mean(busy):.2f}; ms from one replay's end to the next's start: median "
                        f"{statistics.median(between):.2f}, mean {statistics.mean(between):.2f}, "
                        f"max {max(between):.2f}\n"
                    )

            # train.py leaves through exit_process (os._exit: no atexit handlers), so report just before it
            def _exit_process(*args, _real=L.exit_process, **kwargs):
                _report()
                _real(*args, **kwargs)

            L.exit_process = _exit_process
        elif _p == "nodecode":
            import recipes.vit.jpeg as J

            def _no_decode(self, files, names, sizes):
                codec = J.nvimgcodec()
                for data in files:
                    stream = codec.CodeStream(data)
                    stream.height, stream.width  # parsed, as the real decode does
                return [torch.empty((3, h, w), dtype=torch.uint8, device=self.device) for h, w in sizes]

            J.JpegDecoder.decode = _no_decode
        elif _p == "poolkeep":
            import ctypes

            import recipes.vit.jpeg as J

            def _init(self, device, *args, _real=J.JpegDecoder.__init__, **kwargs):
                _real(self, device, *args, **kwargs)
                if device.type != "cuda":
                    return
                cu = ctypes.CDLL("libcuda.so.1")
                ordinal = device.index if device.index is not None else torch.cuda.current_device()
                dev, pool = ctypes.c_int(), ctypes.c_void_p()
                threshold, release_threshold = ctypes.c_uint64(2**64 - 1), 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
                rcs = [cu.cuDeviceGet(ctypes.byref(dev), ordinal)]
                rcs.append(cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev))
                rcs.append(cu.cuMemPoolSetAttribute(pool, release_threshold, ctypes.byref(threshold)))
                check = ctypes.c_uint64()
                rcs.append(cu.cuMemPoolGetAttribute(pool, release_threshold, ctypes.byref(check)))
                with open(os.environ.get("REPLAY_TIMES_FILE", "/tmp/replay_times.txt"), "a") as f:
                    f.write(f"poolkeep: CUDA results {rcs} (0: success), release threshold now {check.value}\n")

            J.JpegDecoder.__init__ = _init
        elif _p == "dali":
            import numpy as np

            import recipes.vit.data as VD

            _pipes: dict = {}

            def _dali_pipeline(device, batch_size, transform):
                from nvidia.dali import fn, pipeline_def, types

                key = (str(device), batch_size)
                if key not in _pipes:
                    gpu = device.type == "cuda"
                    index = (device.index if device.index is not None else torch.cuda.current_device()) if gpu else None

                    @pipeline_def(batch_size=batch_size, num_threads=4, device_id=index, prefetch_queue_depth=1)
                    def crops_pipeline():
                        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
                        windows = fn.external_source(name="windows", dtype=types.INT32)  # x, y, width, height
                        flips = fn.external_source(name="flips", dtype=types.INT32)
                        images = fn.decoders.image_slice(
                            jpegs,
                            fn.slice(windows, 0, 2, axes=[0]),
                            fn.slice(windows, 2, 2, axes=[0]),
                            device="mixed" if gpu else "cpu",
                            output_type=types.RGB,
                            normalized_anchor=False,
                            normalized_shape=False,
                            **({"hw_decoder_load": _DALI_LOAD[0]} if _DALI_LOAD else {}),
                        )
                        size = [transform.size, transform.size]
                        images = fn.resize(images, size=size, antialias=True, interp_type=types.INTERP_LINEAR)
                        return fn.crop_mirror_normalize(
                            images,
                            mirror=flips,
                            dtype=types.FLOAT,
                            output_layout="CHW",
                            mean=[255 * m for m in transform.mean],
                            std=[255 * s for s in transform.std],
                        )

                    pipe = crops_pipeline()
                    pipe.build()
                    _pipes[key] = pipe
                return _pipes[key]

            def _decode_batch(batch, transform, device, backend="auto", _real=VD.decode_batch):
                crops = batch["crop"].tolist()
                if any(crop[2] < 0 for crop in crops):  # validation geometry: the committed path
                    return _real(batch, transform, device, backend)
                ends = batch["jpeg_sizes"].cumsum(0).tolist()
                joined = batch["jpeg"].numpy()
                files = [joined[end - size : end] for end, size in zip(ends, batch["jpeg_sizes"].tolist())]
                pipe = _dali_pipeline(device, len(files), transform)
                pipe.feed_input("jpegs", files)
                pipe.feed_input("windows", [np.array([c[1], c[0], c[3], c[2]], dtype=np.int32) for c in crops])
                pipe.feed_input("flips", [np.array(c[4], dtype=np.int32) for c in crops])
                (out,) = pipe.run()
                dense = out.as_tensor()
                if device.type == "cuda":
                    from nvidia.dali.plugin.pytorch import feed_ndarray

                    pixels = torch.empty(dense.shape(), dtype=torch.float32, device=device)
                    feed_ndarray(dense, pixels, cuda_stream=torch.cuda.current_stream(device))
                else:
                    pixels = torch.from_numpy(np.array(dense))
                rest = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k not in VD.HOST_ONLY}
                return {"image": pixels, **rest}

            import recipes.vit.recipe as VR

            VD.decode_batch = VR.decode_batch = _decode_batch
        elif _p == "gctime":
            import gc
            import time

            import core.distributed.launch as L

            _collections, _started = [], {}

            def _on_gc(phase, info):
                if phase == "start":
                    _started["t"] = time.perf_counter()
                elif "t" in _started:
                    ms = 1000 * (time.perf_counter() - _started.pop("t"))
                    _collections.append((info["generation"], ms, gc.get_freeze_count() > 0))

            gc.callbacks.append(_on_gc)

            def _gc_report():
                data = " ".join(a for a in sys.argv[1:] if a.startswith("data"))
                per_gen = {g: [ms for gen, ms, _ in _collections if gen == g] for g in (0, 1, 2)}
                summary = ", ".join(f"gen{g}: {len(v)} in {sum(v):.0f} ms" for g, v in per_gen.items())
                long = [f"gen{g} {ms:.0f} ms{' (frozen)' if f else ''}" for g, ms, f in _collections if ms > 20]
                with open(os.environ.get("REPLAY_TIMES_FILE", "/tmp/replay_times.txt"), "a") as f:
                    f.write(f"{data}: collections {summary}; over 20 ms: {long}; frozen {gc.get_freeze_count()}\n")

            def _exit_process_gc(*args, _real=L.exit_process, **kwargs):
                _gc_report()
                _real(*args, **kwargs)

            L.exit_process = _exit_process_gc
        elif _p == "gcfreeze":
            import gc

            _graph_replay = torch.cuda.CUDAGraph.replay
            _frozen = []

            def _replay_after_freeze(self, _replay=_graph_replay):
                if not _frozen:
                    gc.collect()
                    gc.freeze()
                    _frozen.append(True)
                _replay(self)

            torch.cuda.CUDAGraph.replay = _replay_after_freeze
        elif _p == "nogcfreeze":
            import core.training.garbage_collection as G

            G.freeze_setup = lambda: None
        elif _p == "gcoff":
            import gc

            gc.disable()
        elif _p.startswith("dalihw="):
            import functools

            from nvidia.dali import fn

            fn.decoders.image_slice = functools.partial(fn.decoders.image_slice, hw_decoder_load=float(_p[7:]))
        elif _p.startswith("dalithreads="):
            import recipes.vit.dali_crops as DC

            DC.CPU_THREADS = int(_p[12:])
        elif _p.startswith("daliload="):
            pass  # read with dali
        else:
            raise ValueError(f"JPEG_PATCH: unknown patch {_p!r}")
    print(f"sitecustomize: JPEG_PATCH={','.join(_PATCHES)} applied", flush=True)
