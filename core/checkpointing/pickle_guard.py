"""One guard for every pickle a checkpoint load reads: DCP's index (`.metadata`), each item of a `.distcp` shard
(tensors and non-tensor values), and torch weight files (`.pt`/`.pth`, Hugging Face `pytorch_model.bin`, in
torch's zip format or the legacy one).

PyTorch's `weights_only` unpickler decides what a pickle may build, but builds what the file asks for before
anyone can look at it: `bytearray(2**32)` from 10 bytes, a storage of the size a tensor claims, and containers
shared through the pickle memo, which cost nothing to build but grow exponentially in whatever copies them out
(`x0 = []; x(k+1) = [x_k, x_k]`: 2**23 lists from 1 KB) or walks them (N entries sharing one list of M chunks:
N x M checks). So before any unpickler runs, the guard follows the pickle's opcodes (`pickletools.genops`) with a
stack of placeholders, building nothing, and refuses, naming what it found:
- a global not on the reader's allow-list (each path lists only the globals its files need: no `bytearray`, no
  `torch.Tensor(n)`), an opcode that is not plain data, a persistent id that is not a storage;
- a pickle whose value, with every shared reference copied out, has more objects than the pickle has bytes
  (plus a small allowance), holds itself, or nests deeper than MAX_DEPTH: work and memory after the load stay
  linear in the file's size, whatever walks the value;
- in a torch file, any storage larger than the data behind it: an archive entry that is compressed or claims
  more bytes than the file holds, a storage whose claimed size is not its record's (zip) or the size stored
  before its data (legacy format), so that no small file makes torch allocate a large storage.
Then PyTorch's own `weights_only` unpickler loads what passed; readers of weight files also refuse, before
anything copies them, a tensor with more elements than its storage holds (`beyond_its_storage`), and tensors that
together hold more than twice the bytes of their storages (`beyond_their_storages`: views of one storage each cost
the whole storage when copied out; tied weights, two tensors of one storage, stay within it).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import warnings
import zipfile
from array import array
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Optional, Union

import torch


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file asks to load something other than checkpoint data."""


class AllowList(frozenset):
    """The globals (`module.name`) a kind of file may name, and how a refusal describes them."""

    holder: str

    def __new__(cls, names, holder: str) -> "AllowList":
        allowed = super().__new__(cls, names)
        allowed.holder = holder  # completes "global X is not one <holder>"
        return allowed


_DTYPE_NAMES = {f"torch.{name}" for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


def _storage_element_sizes() -> dict[str, int]:
    """Storage classes as torch.save names them in a tensor's persistent id, with their element sizes."""
    with warnings.catch_warnings():  # asking a typed storage class its dtype warns that TypedStorage is deprecated
        warnings.simplefilter("ignore", UserWarning)
        sizes = {
            f"torch.{name}": torch._utils._element_size(getattr(torch, name).dtype)
            for name in dir(torch)
            if name.endswith("Storage")
            and name != "Storage"  # (an alias)
            and isinstance(getattr(getattr(torch, name), "dtype", None), torch.dtype)
        }
    # Files saved from a GPU in the legacy format name the CUDA classes (loaded onto the CPU all the same).
    on_gpu = {f"torch.cuda.{name[6:]}": size for name, size in sizes.items() if hasattr(torch.cuda, name[6:])}
    return sizes | on_gpu | {"torch.storage.UntypedStorage": 1}


STORAGE_ELEMENT_SIZES = _storage_element_sizes()

# What torch.save writes for a tensor (a Parameter, a dtype of the newer ones) and nothing else.
TENSOR_GLOBALS = AllowList(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "collections.OrderedDict",
    }
    | set(STORAGE_ELEMENT_SIZES)
    | _DTYPE_NAMES,
    "a saved tensor is built with",
)
# Tensors and plain data beside them: containers, numbers, strings, bytes (protocol 2 writes them as
# _codecs.encode of a string), sizes, devices, layouts.
PLAIN_DATA_GLOBALS = AllowList(
    TENSOR_GLOBALS
    | {"_codecs.encode", "torch.Size", "torch.device", "torch.serialization._get_layout"}
    | {f"{module}.{name}" for module in ("builtins", "__builtin__") for name in ("set", "frozenset", "complex")},
    "plain data is saved with",
)

MAX_PICKLE = 64 << 20  # a torch file's pickle (its tensor data lives beside it), in bytes
MAX_INDEX_PICKLE = 1 << 30  # a DCP index (.metadata), in bytes: a million chunks take a few hundred MB
MAX_DEPTH = 100  # containers inside containers; checkpoints nest a few levels
SHARING_ALLOWANCE = 4096  # objects a copied-out value may have beyond one per byte of its pickle
VIEWS_PER_STORAGE = 2  # the bytes a weight file's tensors may hold, per byte of their storages: tied weights are 2
VIEWS_ALLOWANCE = 1 << 20  # bytes its tensors may hold beyond that (small overlapping views of small storages)

# ---- following the opcodes

_SCALARS = (
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "BINFLOAT",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "SHORT_BINSTRING",
)
_BUILT_IN = frozenset({"list", "dict", "tuple", "set", "frozenset"})  # containers that BUILD may not change


class _Global(str):
    """A global's `module.name`, as a value on the stack."""


class _Walk:
    """The stack of a pickle's opcodes with placeholders instead of objects. A scalar is kept as `(value,)`; a
    container as its number, with the containers it holds (once per reference) and how many scalars. Sharing
    through the memo makes the containers a graph; `size` holds, per container, how many objects copying it out
    would build, as far as the opcodes so far tell (a container only grows, so this never overstates), and a
    container past `limit` is refused at once; `finish` counts the whole graph exactly, once per container."""

    def __init__(self, allowed: AllowList, limit: int, persistent_ids: bool):
        self.allowed, self.limit, self.persistent_ids = allowed, limit, persistent_ids
        self.stack: list = []
        self.marks: list[list] = []
        self.memo: dict[int, Any] = {}
        self.kinds: list[str] = []  # per container: "list", "dict", "tuple", ... or the global that built it
        self.holds: list[Optional[list[int]]] = []  # None for a container of scalars only: most of them
        self.scalars = array("q")
        self.size = array("q")
        self.values: dict[int, tuple] = {}  # small tuples of scalars, by container: storage ids among them
        self.storages: list[tuple] = []  # the persistent ids (storage claims), as values
        self.handlers = {name: self._scalar for name in _SCALARS} | {
            "EMPTY_TUPLE": lambda arg, at: self.stack.append(((),)),
            "EMPTY_LIST": lambda arg, at: self.stack.append(self.new("list")),
            "EMPTY_DICT": lambda arg, at: self.stack.append(self.new("dict")),
            "EMPTY_SET": lambda arg, at: self.stack.append(self.new("set")),
            "BINPUT": self._put,
            "LONG_BINPUT": self._put,
            "MEMOIZE": lambda arg, at: self._put(len(self.memo), at),
            "BINGET": self._get,
            "LONG_BINGET": self._get,
            "MARK": self._mark,
            "APPEND": lambda arg, at: self.add(self.stack[-2], [self.stack.pop()]),
            "SETITEM": lambda arg, at: self.add(self.stack[-3], [self.stack.pop(-2), self.stack.pop()]),
            "APPENDS": self._add_marked,
            "SETITEMS": self._add_marked,
            "ADDITEMS": self._add_marked,
            "TUPLE": lambda arg, at: self._push_tuple(self.pop_mark()),
            "TUPLE1": lambda arg, at: self._push_tuple([self.stack.pop()]),
            "TUPLE2": lambda arg, at: self._push_tuple(self.pop(2)),
            "TUPLE3": lambda arg, at: self._push_tuple(self.pop(3)),
            "FROZENSET": lambda arg, at: self.stack.append(self.new("frozenset", self.pop_mark())),
            "GLOBAL": self._global,
            "STACK_GLOBAL": self._global,
            "REDUCE": self._call,
            "NEWOBJ": self._call,
            "BUILD": self._build,
            "PROTO": lambda arg, at: None,
            "FRAME": lambda arg, at: None,
        }
        if persistent_ids:
            self.handlers["BINPERSID"] = self._persistent_id

    # -- the containers

    def new(self, kind: str, items: list = ()) -> int:
        number = len(self.kinds)
        self.kinds.append(kind)
        self.holds.append(None)
        self.scalars.append(0)
        self.size.append(1)
        if items:
            self.add(number, items)
        return number

    def add(self, container: Any, items: list) -> None:
        if type(container) is not int:
            raise UnsafeCheckpoint(f"adds items to {_shown(container)}, which is not a container")
        size, scalars, grown = self.size, 0, 0
        for item in items:
            if type(item) is int:
                if self.holds[container] is None:
                    self.holds[container] = []
                self.holds[container].append(item)
                grown += size[item]
            else:
                scalars += 1
        self.scalars[container] += scalars
        size[container] = min(size[container] + grown + scalars, self.limit + 1)
        if size[container] > self.limit:
            raise UnsafeCheckpoint(self.describe_sharing(container, self.limit))

    def pop(self, count: int) -> list:
        items = self.stack[-count:]
        if len(items) != count:
            raise IndexError
        del self.stack[-count:]
        return items

    def pop_mark(self) -> list:
        items, self.stack = self.stack, self.marks.pop()
        return items

    # -- the opcodes

    def _scalar(self, arg: Any, at: int) -> None:
        self.stack.append((arg,))

    def _put(self, arg: int, at: int) -> None:
        self.memo[arg] = self.stack[-1]

    def _get(self, arg: int, at: int) -> None:
        if arg not in self.memo:
            raise UnsafeCheckpoint(f"a memo read at byte {at} of entry {arg}, which was never set")
        self.stack.append(self.memo[arg])

    def _mark(self, arg: None, at: int) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def _add_marked(self, arg: None, at: int) -> None:
        items = self.pop_mark()
        self.add(self.stack[-1], items)

    def _push_tuple(self, items: list) -> None:
        number = self.new("tuple", items)
        if self.persistent_ids and len(items) <= 6:  # a storage's persistent id, or a part of one
            known = [item[0] if type(item) is tuple else self.values.get(item, ...) for item in items]
            if ... not in known:
                self.values[number] = tuple(known)
        self.stack.append(number)

    def _global(self, arg: Optional[str], at: int) -> None:
        if arg is not None:  # GLOBAL: "module name"
            module, _, name = arg.partition(" ")
        else:  # STACK_GLOBAL: the two strings on the stack
            module, name = self.pop(2)
            if not (type(module) is tuple and type(module[0]) is str and type(name) is tuple and type(name[0]) is str):
                raise UnsafeCheckpoint(f"opcode STACK_GLOBAL at byte {at} names a global by computed values")
            module, name = module[0], name[0]
        if f"{module}.{name}" not in self.allowed:
            raise UnsafeCheckpoint(f"global {module}.{name} at byte {at} is not one {self.allowed.holder}")
        self.stack.append((_Global(f"{module}.{name}"),))

    def _call(self, arg: None, at: int) -> None:  # REDUCE, NEWOBJ: what it builds holds at most its arguments
        made, args = self.pop(2)
        self.stack.append(self.new(made[0] if type(made) is tuple and type(made[0]) is _Global else "object", [args]))

    def _build(self, arg: None, at: int) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) is not int or self.kinds[target] in _BUILT_IN:
            raise UnsafeCheckpoint(
                f"opcode BUILD at byte {at} sets the state of {_shown(target)}, not of an object the pickle built"
            )
        self.add(target, [state])

    def _persistent_id(self, arg: None, at: int) -> None:
        pid = self.stack.pop()
        claim = self.values.get(pid) if type(pid) is int else None
        if not claim or claim[0] != "storage":
            raise UnsafeCheckpoint(f"opcode BINPERSID at byte {at} loads {_shown(pid)}, not a tensor's storage")
        self.storages.append(claim)
        self.stack.append(("storage",))

    # -- the whole value

    def finish(self, length: int) -> None:
        """At STOP: refuse a value that holds itself, nests deeper than MAX_DEPTH or, copied out, has more
        objects than the pickle's `length` bytes (plus SHARING_ALLOWANCE)."""
        if len(self.stack) != 1 or self.marks:
            raise UnsafeCheckpoint("a pickle that does not end with exactly one value")
        root = self.stack[0]
        if type(root) is not int:
            return
        limit = length + SHARING_ALLOWANCE
        size, depth = self.count(root, limit)
        if depth[root] > MAX_DEPTH:
            raise UnsafeCheckpoint(f"a pickle nested more than {MAX_DEPTH} containers deep")
        if size[root] > limit:
            raise UnsafeCheckpoint(self.describe_sharing(root, limit))

    def count(self, root: int, cap: int, order: Optional[list] = None) -> tuple[array, bytearray]:
        """Each container's copied-out size (capped at cap + 1) and depth (capped at MAX_DEPTH + 1), for those
        reachable from `root`, visited once each (linear in the pickle's size); appended to `order`, each
        after those it holds. Depth first, each container pushed again to be counted once those it holds are."""
        holds, scalars = self.holds, self.scalars
        state = bytearray(len(self.kinds))  # 0 unseen, 1 on the path from root, 2 counted
        size, depth = array("q", bytes(8 * len(self.kinds))), bytearray(len(self.kinds))
        pending = [root]
        while pending:
            number = pending.pop()
            if state[number] == 0:
                state[number] = 1
                pending.append(number)
                for child in holds[number] or ():
                    if state[child] == 1:
                        raise UnsafeCheckpoint(f"a pickle with a {self.kinds[child]} that holds itself")
                    if state[child] == 0:
                        pending.append(child)
            elif state[number] == 1:
                state[number] = 2
                total, deepest = 1 + scalars[number], 0
                for child in holds[number] or ():
                    total += size[child]
                    if depth[child] > deepest:
                        deepest = depth[child]
                size[number], depth[number] = min(total, cap + 1), min(deepest + 1, MAX_DEPTH + 1)
                if order is not None:
                    order.append(number)
        return size, depth

    def describe_sharing(self, root: int, limit: int) -> str:
        """Which container under `root` the pickle shares most, and that copying `root` out would build more than
        `limit` objects."""
        order: list[int] = []
        size, _ = self.count(root, limit, order)
        copies = {root: 1}
        for number in reversed(order):  # each container before those it holds
            for child in self.holds[number] or ():
                copies[child] = min(copies.get(child, 0) + copies[number], 1 << 62)
        shared = max(copies, key=lambda n: (copies[n], size[n]))
        return (
            f"a pickle that shares one {self.kinds[shared]} at least {copies[shared]:,} times: copied out, it "
            f"would be more than {limit:,} objects (one per byte of the pickle, and {SHARING_ALLOWANCE} more)"
        )


def _shown(item: Any) -> str:
    if type(item) is tuple:
        return f"the global {item[0]}" if type(item[0]) is _Global else f"a {type(item[0]).__name__}"
    return "a container"


def guarded_opcodes(
    source: Union[bytes, BinaryIO], allowed: AllowList, storages: Optional[list] = None, max_length: int = MAX_PICKLE
) -> Iterator[tuple[Any, Any, int]]:
    """pickletools.genops(source), refusing (UnsafeCheckpoint) what the module docstring lists as it goes and,
    at its STOP, a value that copying out would make larger than the pickle. Persistent ids (a torch file's
    storages) are refused unless `storages` is a list, to which each storage claimed is appended as a tuple of
    its values; a pickle longer than `max_length` bytes is refused."""
    if isinstance(source, bytes):
        start, length = 0, len(source)
    else:
        start = source.tell()
        length = source.seek(0, io.SEEK_END) - start
        source.seek(start)
    walk = _Walk(allowed, min(length, max_length) + SHARING_ALLOWANCE, persistent_ids=storages is not None)
    ops, handlers = pickletools.genops(source), walk.handlers
    while True:
        try:
            op, arg, at = next(ops)
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001  (any parse error means: not a pickle we read)
            raise UnsafeCheckpoint(f"not a readable pickle ({type(e).__name__}: {e})") from None
        if at - start > max_length:
            raise UnsafeCheckpoint(f"a pickle of more than {max_length:,} bytes")
        if op.name == "STOP":
            walk.finish(at + 1 - start)
            if storages is not None:
                storages.extend(walk.storages)
        else:
            handler = handlers.get(op.name)
            if handler is None:
                raise UnsafeCheckpoint(f"opcode {op.name} at byte {at} is not plain data")
            try:
                handler(arg, at)
            except (IndexError, KeyError):  # an empty stack, no MARK to pop to
                raise UnsafeCheckpoint(f"opcode {op.name} at byte {at} finds no value it needs") from None
        yield op, arg, at


def check_pickle(source: Union[bytes, BinaryIO], allowed: AllowList, storages: Optional[list] = None) -> None:
    """Refuse (UnsafeCheckpoint) a pickle the guard does not pass (guarded_opcodes)."""
    for _ in guarded_opcodes(source, allowed, storages):
        pass


# ---- torch files: torch.save's zip archive, or the legacy format


def check_torch_file(file: BinaryIO, allowed: AllowList, zip_only: bool = False) -> None:
    """Refuse (UnsafeCheckpoint) a torch.save file (`file` open for reading) whose pickle the guard does not
    pass, or whose storages claim more than the data behind them (the module docstring); `zip_only`: refuse
    the legacy format too. ValueError for a file of neither format. Leaves the file at its start."""
    length = file.seek(0, io.SEEK_END)
    file.seek(0)
    if file.read(4) == b"PK\x03\x04":  # what torch.load takes for its zip format
        _check_archive(file, length, allowed)
    elif zip_only:
        raise UnsafeCheckpoint("not a torch.save archive")
    else:
        _check_legacy(file, length, allowed)
    file.seek(0)


def _check_archive(file: BinaryIO, length: int, allowed: AllowList) -> None:
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
            names = [entry.filename for entry in entries]
            folder = names[0].partition("/")[0] if names else ""
            strays = [name for name in names if name.partition("/")[0] != folder or "/" not in name]
            if not names or strays or len(set(names)) != len(names):
                raise UnsafeCheckpoint(f"not a torch.save archive (its entries: {', '.join(names[:4])}...)")
            packed = [
                e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED or e.compress_size != e.file_size
            ]
            if packed:
                raise UnsafeCheckpoint(f"its entry {packed[0]} is compressed (torch.save stores every entry as it is)")
            if sum(e.file_size for e in entries) > length:
                raise UnsafeCheckpoint(f"its entries claim more bytes than the file's {length}")
            records = {e.filename[len(folder) + 1 :]: e.file_size for e in entries}
            if "data.pkl" not in records:
                raise UnsafeCheckpoint(f"not a torch.save archive (no {folder}/data.pkl)")
            if records["data.pkl"] > MAX_PICKLE:
                raise UnsafeCheckpoint(f"its pickle is {records['data.pkl']} bytes (at most {MAX_PICKLE})")
            pickled = archive.read(f"{folder}/data.pkl")
    # NotImplementedError: a header asks for a zip version Python cannot read (one flipped bit makes it so).
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise UnsafeCheckpoint(f"not a torch.save archive ({type(e).__name__}: {e})") from None
    storages: list[tuple] = []
    check_pickle(pickled, allowed, storages)
    for claim in storages:
        storage_type, key, numel = _storage_claim(claim, 5)
        record = records.get(f"data/{key}")
        element_size = STORAGE_ELEMENT_SIZES[storage_type]
        if record is None or record != numel * element_size:
            held = "no record" if record is None else f"{record:,} bytes"
            raise UnsafeCheckpoint(
                f"a storage of {numel:,} x {element_size} bytes (key {key!r:.60}), where the archive holds {held}"
            )


def _storage_claim(claim: tuple, fields: int) -> tuple[str, str, int]:
    """(storage type, key, element count) of a persistent id of `fields` fields (5 in the zip format, 6 in the
    legacy one)."""
    if (
        len(claim) != fields
        or not isinstance(claim[1], _Global)
        or claim[1] not in STORAGE_ELEMENT_SIZES
        or not isinstance(claim[2], str)
        or type(claim[4]) is not int
        or claim[4] < 0
    ):
        raise UnsafeCheckpoint(f"a storage id {claim!r:.200} that torch.save does not write")
    return str(claim[1]), claim[2], claim[4]


_NO_GLOBALS = AllowList((), "the header of a torch file holds")


def _check_legacy(file: BinaryIO, length: int, allowed: AllowList) -> None:
    """torch.save's format before its zip archive: a magic number, a protocol version and system information
    (three small pickles), the object's pickle, a pickle of the storage keys, then each storage as its element
    count (8 bytes) and its data. torch allocates each storage as the object's pickle claims it, before it
    reads the count: each claim must be the count and data the file holds."""
    file.seek(0)
    try:
        check_pickle(file, _NO_GLOBALS)
        file.seek(0)
        magic = torch._weights_only_unpickler.load(file)
    except (UnsafeCheckpoint, pickle.UnpicklingError, EOFError):
        magic = None
    if magic != torch.serialization.MAGIC_NUMBER:
        raise ValueError("not a torch.save file (neither a zip archive nor torch's magic number at its start)")
    for _ in range(2):
        check_pickle(file, _NO_GLOBALS)
    claims: dict[str, tuple[int, int]] = {}
    storages: list[tuple] = []
    check_pickle(file, allowed, storages)
    for claim in storages:
        storage_type, key, numel = _storage_claim(claim, 6)
        claims.setdefault(key, (numel, STORAGE_ELEMENT_SIZES[storage_type]))
        if claims[key] != (numel, STORAGE_ELEMENT_SIZES[storage_type]):
            raise UnsafeCheckpoint(f"two different sizes claimed for the storage {key!r}")
    at = file.tell()
    check_pickle(file, _NO_GLOBALS)
    file.seek(at)
    keys = torch._weights_only_unpickler.load(file)
    if type(keys) is not list or not all(type(key) is str for key in keys) or len(set(keys)) != len(keys):
        raise UnsafeCheckpoint("its list of storages is not a list of distinct names")
    position = file.tell()
    for key in keys:
        if key not in claims:
            raise UnsafeCheckpoint(f"the file stores a storage {key!r:.60} that its pickle does not hold")
        numel, element_size = claims[key]
        file.seek(position)
        stored = file.read(8)
        count = struct.unpack("<q", stored)[0] if len(stored) == 8 else None
        if count != numel or position + 8 + numel * element_size > length:
            raise UnsafeCheckpoint(
                f"the storage {key!r:.60} claims {numel:,} elements, where the file holds "
                f"{'a count of ' + format(count, ',') if count is not None else 'no count'} and "
                f"{max(0, length - position - 8):,} bytes"
            )
        position += 8 + numel * element_size
    unread = sorted(set(claims) - set(keys))
    if unread:
        raise UnsafeCheckpoint(f"the storage {unread[0]!r} is claimed but not stored")


def load_torch_file(source: Union[str, Path, bytes], allowed: AllowList = PLAIN_DATA_GLOBALS) -> Any:
    """torch.load(weights_only=True) of a torch.save file (a path, or its bytes) that the guard passed first,
    onto the CPU. UnsafeCheckpoint for what the guard refuses; torch's own errors for a malformed file."""
    with io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb") as file:
        check_torch_file(file, allowed)
        return torch.load(file, map_location="cpu", weights_only=True)


def beyond_its_storage(tensor: torch.Tensor) -> Optional[str]:
    """Why `tensor` has more elements than its storage holds (a broadcast or overlapping view: torch.save keeps the
    storage, so a few bytes on disk can claim a tensor of any size, which whatever copies it then allocates), or
    None. A state dict's tensors hold their own elements; tied ones share a storage, each within it."""
    held = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
    if tensor.numel() > held:
        return f"a view of {tensor.numel():,} elements over a storage of {held:,}"
    return None


def beyond_their_storages(tensors: Iterable[torch.Tensor]) -> Optional[str]:
    """Why `tensors` together hold more bytes than VIEWS_PER_STORAGE times their storages (and VIEWS_ALLOWANCE more),
    or None: torch.save keeps a storage once however many tensors view it, so thousands of full views of one storage
    cost thousands of times the file when copied out, each passing `beyond_its_storage`."""
    count, held, storages = 0, 0, {}
    for tensor in tensors:
        count, held = count + 1, held + tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    stored = sum(storages.values())
    if held > VIEWS_PER_STORAGE * stored + VIEWS_ALLOWANCE:
        return (
            f"its {count:,} tensors hold {held:,} bytes, over storages of {stored:,} bytes in all "
            f"(tensors may hold at most {VIEWS_PER_STORAGE} x their storages' bytes, tied weights, and "
            f"{VIEWS_ALLOWANCE:,} more: copying out each view costs its whole size)"
        )
    return None
