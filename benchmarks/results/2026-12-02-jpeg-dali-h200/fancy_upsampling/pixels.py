import sys, functools, torch
sys.path.insert(0, ".")
import pytest
from pathlib import Path
import tests.gpu.test_jpeg_decoding as T
from nvidia.dali import fn
from core.data.datasets import EpochIndex
from recipes.vit.config import IMAGENET_STD
from recipes.vit.data import collate_encoded, decode_batch
import recipes.vit.dali_crops as D
root = Path("/tmp/pxjpegs")
import shutil; shutil.rmtree(root, ignore_errors=True)
class F:
    def mktemp(self, n): root.mkdir(); return root
jp = T.jpegs.__wrapped__(F())
real = fn.decoders.image_slice
for fancy in (False, True):
    fn.decoders.image_slice = functools.partial(real, jpeg_fancy_upsampling=fancy)
    D._per_thread.__dict__.clear()
    plain, enc = T.datasets(jp, "workers")[0], T.datasets(jp, "device")[0]
    keys = [EpochIndex(0, i) for i in range(len(plain))]
    b = decode_batch(collate_encoded([enc[k] for k in keys]), enc.transform, torch.device("cuda"), "dali")
    exp = plain.transform.normalize(torch.stack([plain[k]["image"] for k in keys]))
    lv = (b["image"].cpu() - exp).abs() * 255 * min(IMAGENET_STD)
    per = lv.flatten(1).amax(1)
    names = [Path(enc.files[k.idx][0]).name for k in keys]
    print("fancy", fancy, "max", float(lv.max()), "mean", float(lv.mean()), [(n, round(float(p), 1)) for n, p in zip(names, per) if p > 3])
