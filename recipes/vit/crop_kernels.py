"""The Triton kernel of `crop_resize.py` (imported only where Triton is: CUDA builds of torch bring it).

One program takes one channel of one image and a block of output pixels. Each output pixel is a weighted mean
of the source pixels under a triangle filter stretched by the downscale factor (antialiased bilinear, as
torch's interpolate(antialias=True) weighs them: torch/aten UpSample's `_compute_weights_aa`), over the crop
window in the source; then rounded as a uint8 image is, and normalized."""

import triton
import triton.language as tl


@triton.jit
def axis_window(o, in_size, out_size):
    """For output positions `o` along one axis (resized length out_size from in_size source pixels): the
    filter's centre, first source index, end, inverse width, and an upper bound on the taps."""
    scale = in_size.to(tl.float32) / out_size.to(tl.float32)
    support = tl.maximum(scale, 1.0)
    inverse = tl.where(scale >= 1.0, 1.0 / scale, 1.0)
    centre = scale * (o.to(tl.float32) + 0.5)
    first = tl.maximum(tl.floor(centre - support + 0.5), 0.0).to(tl.int32)
    end = tl.minimum(tl.floor(centre + support + 0.5).to(tl.int32), in_size)
    taps = (2.0 * support + 2.0).to(tl.int32)
    return centre, first, end, inverse, taps


@triton.jit
def triangle(x, centre, inverse):
    return tl.maximum(1.0 - tl.abs((x.to(tl.float32) - centre + 0.5) * inverse), 0.0)


@triton.jit
def crop_resize_normalize(pixels, windows, mean, std, out, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    # windows, per image (int64): start in `pixels`, height, width, source window (top, left, height, width),
    # resized size (height, width), offset of the output in the resized image (top, left), flip. (Not named
    # `params`: Triton's launcher binds the arguments in a function with a local of that name.)
    image, channel, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = windows + image * 12
    start, height, width = tl.load(p), tl.load(p + 1), tl.load(p + 2)
    top, left, in_h, in_w = tl.load(p + 3), tl.load(p + 4), tl.load(p + 5).to(tl.int32), tl.load(p + 6).to(tl.int32)
    out_h, out_w = tl.load(p + 7).to(tl.int32), tl.load(p + 8).to(tl.int32)
    shift_y, shift_x, flip = tl.load(p + 9).to(tl.int32), tl.load(p + 10).to(tl.int32), tl.load(p + 11)

    index = block * BLOCK + tl.arange(0, BLOCK)
    valid = index < SIZE * SIZE
    oy, ox = index // SIZE, index % SIZE
    ox = tl.where(flip != 0, SIZE - 1 - ox, ox)
    cy, y0, y_end, inv_y, taps_y = axis_window(oy + shift_y, in_h, out_h)
    cx, x0, x_end, inv_x, taps_x = axis_window(ox + shift_x, in_w, out_w)

    plane = pixels + start + channel * height * width
    total = tl.zeros([BLOCK], dtype=tl.float32)
    weights = tl.zeros([BLOCK], dtype=tl.float32)
    for ky in range(0, taps_y):
        y = y0 + ky
        wy = tl.where(y < y_end, triangle(y, cy, inv_y), 0.0)
        row = plane + (y + top) * width + left
        for kx in range(0, taps_x):
            x = x0 + kx
            inside = valid & (y < y_end) & (x < x_end)
            w = tl.where(inside, wy * triangle(x, cx, inv_x), 0.0)
            value = tl.load(row + x, mask=inside, other=0).to(tl.float32)
            total += w * value
            weights += w
    value = total / tl.where(weights > 0, weights, 1.0)
    # Rounded half to even, as torch.round rounds the CPU path's resized pixels.
    rounded = tl.floor(value + 0.5)
    odd = rounded - 2.0 * tl.floor(rounded * 0.5)
    rounded = tl.where((rounded - value == 0.5) & (odd == 1.0), rounded - 1.0, rounded)
    rounded = tl.minimum(tl.maximum(rounded, 0.0), 255.0)
    result = (rounded / 255.0 - tl.load(mean + channel)) / tl.load(std + channel)
    tl.store(out + (image * 3 + channel) * SIZE * SIZE + index, result, mask=valid)
