"""Probe-only patches of recipes/vit/jpeg.py for an A/B inside training (not the product): put this folder on
PYTHONPATH and name the patches in JPEG_PATCH (comma-separated):
  cputhreads=N  the nvImageCodec decoder's CPU threads (its default: one per core)
  ownstream     each decoder decodes on a stream of its own (the batch's stream waits for it), so a decode does
                not wait for the previous batch's crop kernel queued on the prefetch thread's stream
  unbounded     CUDA-graph replays queued without bound, as before core/training/cuda_graphs.py's QueueBound
  trainprio     (for a next lease; not run yet) the training process's main thread works on a high-priority stream
                from the start, so the step's kernels go before the decoder's when both wait for the SMs"""

import os

_PATCHES = [p for p in os.environ.get("JPEG_PATCH", "").split(",") if p]
if _PATCHES:
    import torch

    import recipes.vit.jpeg as J

    for _p in _PATCHES:
        if _p.startswith("cputhreads="):
            _n = int(_p.split("=")[1])

            def _gpu_decoder(codec, device, backend, _n=_n):
                index = device.index if device.index is not None else torch.cuda.current_device()
                kind = codec.BackendKind.HW_GPU_ONLY if backend in ("auto", "hardware") else codec.BackendKind.HYBRID_CPU_GPU
                decoder = codec.Decoder(device_id=index, backends=[codec.Backend(kind)], max_num_cpu_threads=_n)
                return decoder, "hardware" if kind == codec.BackendKind.HW_GPU_ONLY else "cuda"

            J.JpegDecoder._gpu_decoder = staticmethod(_gpu_decoder)
        elif _p == "ownstream":
            _orig = J.JpegDecoder.decode

            def _decode(self, files, names, sizes, _orig=_orig):
                current = torch.cuda.current_stream(self.device)
                own = self.__dict__.setdefault("_own_stream", torch.cuda.Stream(self.device))
                with torch.cuda.stream(own):
                    out = _orig(self, files, names, sizes)
                current.wait_stream(own)
                return out

            J.JpegDecoder.decode = _decode
        elif _p == "trainprio":
            import core.distributed.env as E

            def _setup(*args, _real=E.setup, **kwargs):
                env = _real(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.set_stream(torch.cuda.Stream(priority=-1))
                return env

            E.setup = _setup
        elif _p == "unbounded":
            import core.training.cuda_graphs as G

            G.REPLAYS_AHEAD = 1 << 30
        else:
            raise ValueError(f"JPEG_PATCH: unknown patch {_p!r}")
    print(f"sitecustomize: JPEG_PATCH={','.join(_PATCHES)} applied", flush=True)
