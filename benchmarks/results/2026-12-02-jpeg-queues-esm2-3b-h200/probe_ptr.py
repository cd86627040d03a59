import sys, time, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import torch
from nvidia import nvimgcodec as c
from benchmarks.jpeg_decoders import generated_jpegs
with tempfile.TemporaryDirectory() as t:
    files = generated_jpegs(512, Path(t))
dec = c.Decoder(backends=[c.Backend(c.BackendKind.HW_GPU_ONLY)])
p = c.DecodeParams(sample_format=c.P_RGB, apply_exif_orientation=False)
s = torch.cuda.Stream()
streams = [c.CodeStream(f) for f in files[:256]]
imgs = dec.decode(streams, params=p, cuda_stream=s.cuda_stream)
torch.cuda.synchronize()
for rep in range(3):
    t0 = time.perf_counter(); ts = [torch.from_dlpack(i) for i in imgs]; t1 = time.perf_counter()
    ptrs = [i.__cuda_array_interface__ for i in imgs]; t2 = time.perf_counter()
    flat = torch.cat([x.reshape(-1) for x in ts]); t3 = time.perf_counter()
    cs = [c.CodeStream(f) for f in files[256:512]]; t4 = time.perf_counter()
    print(f"dlpack {1e3*(t1-t0):.1f} ms, cai {1e3*(t2-t1):.1f} ms, cat {1e3*(t3-t2):.1f} ms, codestreams {1e3*(t4-t3):.1f} ms")
print(ptrs[0], imgs[0].strides, imgs[0].capacity, imgs[0].size, imgs[0].shape)
# reuse: does the decode into old images change pointers?
old = [i.__cuda_array_interface__["data"][0] for i in imgs]
imgs2 = dec.decode(cs, images=imgs, params=p, cuda_stream=s.cuda_stream)
torch.cuda.synchronize()
new = [i.__cuda_array_interface__["data"][0] for i in imgs2]
print("same objects", sum(a is b for a, b in zip(imgs, imgs2)), "same ptrs", sum(a == b for a, b in zip(old, new)), "of", len(old))
# allocation sync probe: decode while a long kernel runs on another stream
busy = torch.cuda.Stream()
for reuse in (False, True, False, True):
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    out = dec.decode(streams, images=imgs if reuse else None, params=p, cuda_stream=s.cuda_stream)
    t1 = time.perf_counter()
    del out
    t2 = time.perf_counter()
    torch.cuda.synchronize(); t3 = time.perf_counter()
    print(f"reuse={reuse}: decode call {1e3*(t1-t0):.1f} ms, free {1e3*(t2-t1):.1f} ms, remaining sleep {1e3*(t3-t2):.1f} ms")
