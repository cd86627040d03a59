"""ESM-2 sequence files as they are found in the wild: compressed, with a byte-order mark, in folders that hold
other splits, cache files or nucleotide FASTA, damaged, or with names that break lines. Each is read as the
user means it or refused with the file named; nothing is dropped or merged silently."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from core.config.errors import ConfigError, DataError
from recipes.esm2 import preprocess
from recipes.esm2.sequences import read_store
from recipes.esm2.tokenizer import decode

FASTA = ">P1 kinase\nMKVLA\nGG\n>P2\nWWW\n"


def sequences(path, **kw) -> list[tuple[str, str]]:
    store = read_store(path, **kw)
    return [(store.name(i), decode(store.sequence(i))) for i in range(len(store))]


def test_compressed_files_and_a_byte_order_mark_are_read(tmp_path):
    expected = [("P1", "MKVLAGG"), ("P2", "WWW")]
    (tmp_path / "bom.fasta").write_bytes(b"\xef\xbb\xbf" + FASTA.encode())
    assert sequences(tmp_path / "bom.fasta") == expected
    for suffix, opener in ((".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)):
        with opener(tmp_path / f"a{suffix[1:]}.fasta{suffix}", "wt") as f:
            f.write(FASTA)
        assert sequences(tmp_path / f"a{suffix[1:]}.fasta{suffix}") == expected, suffix
    with pa.CompressedOutputStream(str(tmp_path / "z.fa.zst"), "zstd") as f:
        f.write(FASTA.encode())
    assert sequences(tmp_path / "z.fa.zst") == expected
    with gzip.open(tmp_path / "t.csv.gz", "wt") as f:
        f.write("id,sequence\nP1,MKVLAGG\nP2,WWW\n")
    assert sequences(tmp_path / "t.csv.gz") == expected
    # Feather v2 (an Arrow IPC file, not the stream `datasets` writes)
    feather.write_feather(pa.table({"id": ["P1", "P2"], "sequence": ["MKVLAGG", "WWW"]}), tmp_path / "f.arrow")
    assert sequences(tmp_path / "f.arrow") == expected
    assert len(read_store(tmp_path)) == 2 * 7  # a folder of all of them (bom.fasta included)


def test_names_are_text_and_survive_the_store_line_for_line(tmp_path):
    # A CSV's ids are text: no "001" -> "1", and an id that is not a number after the first block is no error.
    rows = "".join(f"{i:05d},MKV\n" for i in range(70_000)) + "P12345,LLA\n"
    (tmp_path / "ids.csv").write_text("id,sequence\n" + rows)
    store = read_store(tmp_path / "ids.csv")
    assert (store.name(0), store.name(70_000), len(store)) == ("00000", "P12345", 70_001)
    # A name holding a carriage return or a line feed keeps every later name in its place in a preprocessed store.
    names = ["first\rX", "second\nY", "third\r\nZ", "fourth", None]
    pq.write_table(pa.table({"id": names, "sequence": ["MKV", "LLA", "WWW", "CCC", "GGG"]}), tmp_path / "n.parquet")
    preprocess.main(["--input", str(tmp_path / "n.parquet"), "--out", str(tmp_path / "store")])
    store = read_store(tmp_path / "store")
    assert [store.name(i) for i in range(5)] == ["first X", "second Y", "third  Z", "fourth", "4"]
    (tmp_path / "store" / "names.txt").write_text("first X\nsecond Y\n")  # names.txt cut short
    with pytest.raises(ConfigError, match="names.txt holds 2 names for 5 sequences"):
        read_store(tmp_path / "store").name(0)


def write_datasets_folder(folder: Path, splits: dict[str, list[tuple[str, str]]]) -> None:
    """A DatasetDict as `datasets.save_to_disk` writes it, with a cache file `.map()` leaves in the train split."""
    folder.mkdir(parents=True)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, named in splits.items():
        table = pa.table({"id": [n for n, _ in named], "sequence": [s for _, s in named]})
        (folder / split).mkdir()
        for name in ("data-00000-of-00001.arrow", "cache-0123456789abcdef.arrow"):
            with pa.ipc.new_stream(folder / split / name, table.schema) as writer:
                writer.write_table(table)
        (folder / split / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )


def test_a_folder_reads_one_split_and_no_cache_files(tmp_path):
    write_datasets_folder(tmp_path / "hub" / "saved", {"train": [("a", "MKV"), ("b", "LLA")], "test": [("t", "WWW")]})
    (tmp_path / "hub" / "extra.fasta").write_text(">e\nCCC\n")
    assert sequences(tmp_path / "hub") == [("e", "CCC"), ("a", "MKV"), ("b", "LLA")]
    assert sequences(tmp_path / "hub", split="test") == [("e", "CCC"), ("t", "WWW")]
    # Hugging Face Hub's layout: one folder, the splits told apart by file name; refused, and a pattern picks one.
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    for split, (name, sequence) in {"train": ("a", "MKV"), "validation": ("v", "LLA"), "test": ("t", "WWW")}.items():
        for shard in range(2):
            pq.write_table(
                pa.table({"id": [f"{name}{shard}"], "sequence": [sequence]}),
                data / f"{split}-0000{shard}-of-00002.parquet",
            )
    with pytest.raises(ConfigError, match=r"several splits .*test: data/test-00000-of-00002.parquet.*data.val_path"):
        read_store(tmp_path / "repo")
    assert sequences(data / "train-*.parquet") == [("a0", "MKV"), ("a1", "MKV")]
    assert sequences(data / "validation-0000[1]-of-*.parquet") == [("v1", "LLA")]
    with pytest.raises(ConfigError, match="the pattern matches nothing"):
        read_store(data / "dev-*.parquet")


def test_files_that_would_be_lost_or_misread_are_refused_by_name(tmp_path):
    folder = tmp_path / "ncbi"
    folder.mkdir()
    (folder / "GCF_1_protein.faa").write_text(">WP_1\nMKVLA\n")
    (folder / "GCF_1_genomic.fna").write_text(">NC_1\nACGTACGTACGTTTGA\n")
    assert sequences(folder) == [("WP_1", "MKVLA")]  # nucleotide FASTA in a folder: not protein, not read
    with pytest.raises(ConfigError, match="GCF_1_genomic.fna: .fna is NCBI's suffix for nucleotide FASTA"):
        read_store(folder / "GCF_1_genomic.fna")
    shutil.copy(folder / "GCF_1_protein.faa", folder / "GCF_1_protein.faa.zip")  # a compression not read here
    with pytest.raises(ConfigError, match=r"cannot read .*GCF_1_protein.faa.zip \(.zip compression"):
        read_store(folder)
    with pytest.raises(ConfigError, match="x.parquet.gz: .gz compression is not read here"):
        (tmp_path / "x.parquet.gz").write_bytes(b"")
        read_store(tmp_path / "x.parquet.gz")
    (tmp_path / "notes.txt").write_text(FASTA)
    with pytest.raises(ConfigError, match="notes.txt: not a sequence file"):
        read_store(tmp_path / "notes.txt")
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "x.fasta").write_text(FASTA)
    with gzip.open(twice / "x.fasta.gz", "wt") as f:
        f.write(FASTA)
    with pytest.raises(ConfigError, match="x.fasta and x.fasta.gz in .* look like one file twice"):
        read_store(twice)
    (tmp_path / "lost.fasta").write_text(">P1 kinase\nMKVLA\nP2 hypothetical protein\nLLAGG\n")
    with pytest.raises(ConfigError, match=r"lost.fasta:3: a digit in a sequence line .*lost its '>'"):
        read_store(tmp_path / "lost.fasta")


def test_damaged_files_are_named_and_preprocess_leaves_nothing_behind(tmp_path, capsys):
    with gzip.open(tmp_path / "full.fa.gz", "wt") as f:
        f.write(FASTA * 50)
    (tmp_path / "cut.fa.gz").write_bytes((tmp_path / "full.fa.gz").read_bytes()[:30])
    table = pa.table({"id": ["a"] * 100, "sequence": ["MKVLA" * 20] * 100})
    pq.write_table(table, tmp_path / "full.parquet")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "full.parquet").read_bytes()[:500])
    (tmp_path / "ragged.csv").write_text("id,sequence\nP1,MKV\nP2,LLA,extra\n")
    (tmp_path / "latin1.csv").write_bytes("id,sequence\nP1,MKV\nPé,LLA\n".encode("latin-1"))
    for name in ("cut.fa.gz", "cut.parquet", "ragged.csv", "latin1.csv"):
        with pytest.raises(ConfigError, match=f"data.path={tmp_path / name}: unreadable"):
            read_store(tmp_path / name)
    with pytest.raises(SystemExit) as stop:
        preprocess.main(["--input", str(tmp_path / "cut.fa.gz"), "--out", str(tmp_path / "store")])
    assert stop.value.code == 2
    assert re.fullmatch(r"error: --input \S*cut.fa.gz: unreadable \(EOFError: .*\)\n", capsys.readouterr().err)
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob("store.partial*"))


def test_preprocess_says_what_tokenizing_left_out(tmp_path, capsys):
    (tmp_path / "odd.fasta").write_text(">ok\nMKVLA\n>stop\nMKV*LA*\n>none\n\n>dna\n" + "ACGT" * 10 + "\n")
    preprocess.main(["--input", str(tmp_path / "odd.fasta"), "--out", str(tmp_path / "store")])
    out = capsys.readouterr().out
    assert "wrote 3 sequences" in out
    assert (
        "note: 1 empty sequences left out (first: 'none'); 2 residues outside the ESM-2 vocabulary read as "
        "<unk> (first: 'stop'); 1 sequences of nucleotide letters only"
    ) in out
    index = json.loads((tmp_path / "store" / "index.json").read_text())
    assert (index["empty_sequences_left_out"], index["unknown_residues"], index["nucleotide_like_sequences"]) == (
        1,
        2,
        1,
    )


def test_errors_name_the_setting_that_gave_the_path(tmp_path, capsys):
    """data.val_path, predict.folder and preprocess's --input / --column name themselves, not data.path."""
    from recipes.esm2.recipe import ESM2Recipe
    from tests.support.helpers import validated_config

    missing = tmp_path / "missing.fasta"
    recipe = ESM2Recipe(validated_config("esm2_sanity", [f"data.val_path={missing}", "checkpoint.path=unused"]))
    with pytest.raises(DataError, match=f"^data.val_path={re.escape(str(missing))}: no such file or folder$"):
        recipe.build_datasets()
    with pytest.raises(DataError, match=f"^predict.folder={re.escape(str(missing))}: no such file or folder$"):
        recipe.unlabeled(str(missing))
    write_datasets_folder(tmp_path / "saved", {"train": [("a", "MKV")]})
    (tmp_path / "saved" / "dataset_dict.json").write_text('{"splits": 5}')
    recipe = ESM2Recipe(validated_config("esm2_sanity", [f"data.val_path={tmp_path / 'saved'}", "checkpoint.path=x"]))
    with pytest.raises(
        DataError,
        match=f"^data.val_path={re.escape(str(tmp_path / 'saved'))}: .*dataset_dict.json "
        "is not what this recipe reads \\(splits=5: Input should be a valid array\\)",
    ):
        recipe.build_datasets()
    (tmp_path / "t.csv").write_text("name,seq\na,MKV\n")
    for argv, says in (
        (["--input", str(missing)], f"--input {missing}: no such file or folder"),
        (
            ["--input", str(tmp_path / "t.csv")],
            f"--column sequence: {tmp_path / 't.csv'} has no such column (it has name, seq)",
        ),
    ):
        with pytest.raises(SystemExit) as stop:
            preprocess.main(argv + ["--out", str(tmp_path / "store")])
        assert stop.value.code == 2 and capsys.readouterr().err == f"error: {says}\n"


@pytest.mark.parametrize(
    "file,content,says",
    [
        ("dataset_dict.json", '{"splits": 5}', "splits=5: Input should be a valid array"),
        ("dataset_dict.json", '{"splits": ["../../etc"]}', "should be the name of a file in the folder"),
        ("dataset_dict.json", "[" * 100_000, "recursion limit exceeded"),
        ("train/state.json", "not JSON", "Invalid JSON"),
        (
            "train/state.json",
            '{"_data_files": "data.arrow"}',
            "_data_files='data.arrow': Input should be a valid array",
        ),
        ("train/state.json", '{"_data_files": []}', "_data_files=\\[\\]: List should have at least 1 item"),
    ],
)
def test_a_damaged_datasets_folder_is_one_line_naming_the_file(tmp_path, file, content, says):
    """Its JSON files of any wrong shape: a DataError naming the setting and the file (not the Hugging Face
    importer's "nothing was imported", not a TypeError)."""
    write_datasets_folder(tmp_path / "saved", {"train": [("a", "MKV")], "test": [("t", "WWW")]})
    (tmp_path / "saved" / file).write_text(content)
    with pytest.raises(DataError) as refused:
        read_store(tmp_path / "saved")
    message = str(refused.value)
    assert re.match(
        f"data.path={re.escape(str(tmp_path / 'saved'))}: {re.escape(str(tmp_path / 'saved' / file))} "
        f"is not what this recipe reads \\(.*{says}.*\\); save the dataset again",
        message,
    ), message
    assert "\n" not in message and "imported" not in message


READ_FOLDER = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from recipes.esm2.sequences import read_store
from recipes.esm2.tokenizer import decode
store = read_store(sys.argv[1])
print(json.dumps([[store.name(i), decode(store.sequence(i))] for i in range(len(store))]))
"""


def test_a_folder_with_link_loops_reads_each_file_once(tmp_path):
    """A `self -> .` link and two `..` links in a folder of FASTA files (the old recursive walk never ended): each
    file is read once, the loops named in a warning; a link to a folder elsewhere is followed once (its file
    counts). Read in a process of its own, limited to 60 s and 2 GiB, so that a regression fails, not hangs."""
    import resource
    import subprocess
    import sys

    from tests.support.helpers import REPO

    data, other = tmp_path / "data", tmp_path / "other"
    (data / "a").mkdir(parents=True)
    other.mkdir()
    (data / "a" / "x.fasta").write_text(">P1\nMKV\n")
    (other / "y.fasta").write_text(">P2\nWWW\n")
    (data / "a" / "self").symlink_to(".")
    (data / "a" / "up").symlink_to("..")
    (data / "up").symlink_to("..")
    (data / "linked").symlink_to(other)
    proc = subprocess.run(
        [sys.executable, "-c", READ_FOLDER, str(data)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [["P1", "MKV"], ["P2", "WWW"]]
    assert "a/self -> ." in proc.stderr and "a/up -> .." in proc.stderr


def test_a_file_a_datasets_folder_lists_must_be_a_regular_file(tmp_path):
    """state.json may name a FIFO (the reader would wait for a writer forever) or a link to /dev/zero (read until
    memory ran out): refused by name, at once, like any other file that is no regular file."""
    import os

    from tests.support.helpers import within

    write_datasets_folder(tmp_path / "saved", {"train": [("a", "MKV")]})
    listed = tmp_path / "saved" / "train" / "data-00000-of-00001.arrow"
    listed.unlink()
    os.mkfifo(listed)
    with within(10), pytest.raises(DataError, match=f"{re.escape(str(listed))}: not a regular file"):
        read_store(tmp_path / "saved")
    listed.unlink()
    listed.symlink_to("/dev/zero")
    with within(10), pytest.raises(DataError, match="not a regular file"):
        read_store(tmp_path / "saved")


def test_an_arrow_file_whose_offsets_run_past_its_data_is_refused(tmp_path):
    """Four bytes changed in a valid IPC stream put a string's end 16 MiB past the data: pyarrow reads such a batch
    without a check and crashed the process (a segmentation fault); each batch is now validated first."""
    import struct

    table = pa.table({"sequence": ["MKTAYIAKQRQISFVKSHFSRQ", "MKVLAAGIVGLLLAQAAAAAAA"]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = bytearray(sink.getvalue().to_pybytes())
    at = data.find(struct.pack("<3i", 0, 22, 44))
    data[at : at + 12] = struct.pack("<3i", 0, 22, 1 << 24)
    (tmp_path / "bad.arrow").write_bytes(data)
    with pytest.raises(DataError, match="bad.arrow: unreadable .*out of bounds"):
        read_store(tmp_path / "bad.arrow")


def test_a_fasta_line_or_record_far_longer_than_a_protein_is_refused(tmp_path, monkeypatch):
    """A 3.5 KB .bz2 held a 3 GB comment line, read whole; a bomb or a file that lost its headers is now refused at
    the bound (made small here), naming the line, before it fills memory."""
    import recipes.esm2.sources as sources

    monkeypatch.setattr(sources, "MAX_SEQUENCE_LENGTH", 100)
    with bz2.open(tmp_path / "bomb.fasta.bz2", "wt") as f:
        f.write(">P1\nMKV\n;" + "A" * 101 + "\n>P2\nWWW\n")
    with pytest.raises(DataError, match="bomb.fasta.bz2:3: a line longer than 100 characters"):
        read_store(tmp_path / "bomb.fasta.bz2")
    (tmp_path / "no_headers.fasta").write_text(">P1\n" + ("M" * 60 + "\n") * 2)
    with pytest.raises(DataError, match="no_headers.fasta:3: sequence 'P1' is longer than 100 residues"):
        read_store(tmp_path / "no_headers.fasta")
    (tmp_path / "at_the_bound.fasta").write_text(">P1\n" + "M" * 100 + "\r\n" + ">P2\nW\n")
    assert sequences(tmp_path / "at_the_bound.fasta") == [("P1", "M" * 100), ("P2", "W")]


def test_csv_columns_as_found_xz_a_column_twice_and_columns_never_read(tmp_path):
    """.csv.xz is read (pyarrow's reader does not decompress xz by itself); a column named twice is refused (it
    was a KeyError traceback); a column the recipe does not read may change type halfway down the file."""
    with lzma.open(tmp_path / "a.csv.xz", "wt") as f:
        f.write("id,sequence\na,MKV\nb,WWW\n")
    assert sequences(tmp_path / "a.csv.xz") == [("a", "MKV"), ("b", "WWW")]
    (tmp_path / "twice.csv").write_text("id,sequence,sequence\na,MKV,MKV\n")
    with pytest.raises(DataError, match="twice.csv: 2 columns are named 'sequence': keep one"):
        read_store(tmp_path / "twice.csv")
    rows = "".join(f"p{i},MKV,{i}\n" for i in range(200_000)) + "last,WWW,unknown\n"
    (tmp_path / "drift.csv").write_text("id,sequence,length\n" + rows)
    store = read_store(tmp_path / "drift.csv")
    assert len(store) == 200_001 and decode(store.sequence(200_000)) == "WWW"


@pytest.mark.parametrize("layout", ["stream", "feather"])
def test_an_arrow_file_that_decompresses_far_past_its_size_is_refused_before_it_is_read(tmp_path, monkeypatch, layout):
    """A 220 KB ZSTD-compressed Arrow file of 20,000 copies of one 100,000-residue sequence took 7.9 GB and 31 s
    to read (pyarrow expands a batch whole); its batches' decompressed size is now read from their headers and
    held to parquet's bound (made small here), before anything is expanded. Feather's default LZ4 still reads."""
    import recipes.esm2.sources as sources

    monkeypatch.setattr(sources, "MIN_BUDGET_BYTES", 1 << 20)
    table = pa.table({"id": [str(i) for i in range(400)], "sequence": ["MKVLA" * 2000] * 400})  # 4 MB of text
    bomb = tmp_path / "bomb.arrow"
    if layout == "feather":
        feather.write_feather(table, bomb, compression="zstd")
    else:
        with pa.ipc.new_stream(bomb, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_table(table)
    assert bomb.stat().st_size < 4096
    with pytest.raises(
        DataError, match=r"bomb.arrow: its batches decompress to more than \d+ bytes, the bound for a file of"
    ):
        read_store(bomb)
    feather.write_feather(table.slice(0, 2), tmp_path / "lz4.arrow")  # within its bound: read as before
    assert sequences(tmp_path / "lz4.arrow") == [("0", "MKVLA" * 2000), ("1", "MKVLA" * 2000)]


def test_a_header_repeated_inside_a_csv_is_refused_not_read_as_the_protein_sequence(tmp_path):
    """Two CSV files joined with their headers trained on the second header as a protein, SEQUENCE, named 'id'; a
    row that only looks like it (a sequence named 'sequence') is still read."""
    (tmp_path / "joined.csv").write_text("id,sequence\nP1,MKV\n" * 2)
    with pytest.raises(DataError, match=r"joined.csv: row 3 repeats the header \(row 1; files joined\?\)"):
        read_store(tmp_path / "joined.csv")
    (tmp_path / "odd.csv").write_text("id,sequence\nsequence,MKV\nP1,sequence\n")
    assert sequences(tmp_path / "odd.csv") == [("sequence", "MKV"), ("P1", "SEQUENCE")]


@pytest.mark.parametrize("name", ["bomb.fasta.bz2", "bomb.tsv.bz2", "bomb.fa.xz"])
def test_a_compressed_text_file_that_expands_far_past_its_size_is_refused(tmp_path, monkeypatch, name):
    """An 11 KB .fasta.bz2 of 2,000 records of 16,000 short lines (2 GB of residues, no line or record too long)
    took 3.8 GB and 2 minutes to read for training; FASTA and CSV/TSV now decompress within parquet's bound (made
    small here) and are refused past it, naming the file."""
    import recipes.esm2.sources as sources

    monkeypatch.setattr(sources, "MIN_BUDGET_BYTES", 1 << 20)
    opener = {".bz2": bz2.open, ".gz": gzip.open, ".xz": lzma.open}[Path(name).suffix]
    fasta = name.endswith((".fasta.bz2", ".fa.xz"))
    with opener(tmp_path / name, "wt") as f:
        f.write("" if fasta else "id\tsequence\n")
        for i in range(64):
            f.write(f">P{i}\n" if fasta else "")
            f.write(("MKVLA" * 12 + "\n") * 500 if fasta else f"Q{i}\t{'MKVLA' * 12}\n" * 500)
    assert (tmp_path / name).stat().st_size < 2048  # and some 2 MB once expanded
    with pytest.raises(DataError, match=rf"{name}: decompresses to more than \d+ bytes, the bound for a file of"):
        read_store(tmp_path / name)
