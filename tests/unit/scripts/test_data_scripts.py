"""The data-making scripts (scripts/): what they write, that reruns write the same bytes, and that the data
the repository ships is what they make."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.helpers import REPO


def run_script(name: str, monkeypatch, *argv: str) -> None:
    """scripts/<name>.py's main() in this process, with that command line."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its worker processes find its functions by name
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    module.main()


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_the_shipped_digits_are_what_the_script_makes(tmp_path, monkeypatch):
    run_script("make_digits_imagefolder", monkeypatch, "--out", str(tmp_path / "digits"))
    made, shipped = sorted((tmp_path / "digits").rglob("*.png")), sorted((REPO / "data" / "digits").rglob("*.png"))
    assert len(made) == 1797
    assert [p.relative_to(tmp_path / "digits") for p in made] == [
        p.relative_to(REPO / "data" / "digits") for p in shipped
    ]
    for a, b in zip(made, shipped):  # the pixels (a PNG's bytes depend on the zlib that wrote it)
        with Image.open(a) as image_a, Image.open(b) as image_b:
            assert image_a.mode == image_b.mode == "L" and np.array_equal(np.asarray(image_a), np.asarray(image_b)), a
    readme = (tmp_path / "digits" / "README.md").read_text().replace(str(tmp_path / "digits"), "data/digits")
    assert readme == (REPO / "data" / "digits" / "README.md").read_text()  # the command that made it included
    with pytest.raises(SystemExit, match="already has PNGs"):  # never mixed with an earlier run's files
        run_script("make_digits_imagefolder", monkeypatch, "--out", str(tmp_path / "digits"))


def test_the_mnist_subset_is_split_per_digit_in_mnist_files(tmp_path, monkeypatch):
    from recipes.mnist.data import read_mnist_file

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 12)  # 12 images per digit, each image's pixels all equal to its row number
    table = np.column_stack([np.repeat(np.arange(120)[:, None] % 256, 784, axis=1), labels])
    source = tmp_path / "mnist.csv"
    np.savetxt(source, table[rng.permutation(120)], delimiter=",", fmt="%d")
    for out in ("a", "b"):
        run_script(
            "make_mnist_subset",
            monkeypatch,
            "--source",
            str(source),
            "--out",
            str(tmp_path / out),
            "--test-per-digit",
            "2",
        )
    assert digests(tmp_path / "a") == digests(tmp_path / "b")  # reruns give the same bytes
    train_images, train_labels = read_mnist_file(str(tmp_path / "a"), True, False)
    test_images, test_labels = read_mnist_file(str(tmp_path / "a"), False, False)
    assert np.bincount(train_labels.numpy()).tolist() == [10] * 10
    assert np.bincount(test_labels.numpy()).tolist() == [2] * 10
    rows = np.concatenate([train_images[:, 0, 0].numpy(), test_images[:, 0, 0].numpy()])
    assert sorted(rows.tolist()) == list(range(120))  # every source row once, in one of the two files
    for images, labels_ in ((train_images, train_labels), (test_images, test_labels)):
        assert (table[images[:, 0, 0].numpy().astype(int), -1] == labels_.numpy()).all()  # each with its label
    with pytest.raises(SystemExit, match="not empty"):
        run_script("make_mnist_subset", monkeypatch, "--source", str(source), "--out", str(tmp_path / "a"))


def test_the_jpeg_folder_has_imagenet_like_sizes_and_is_reproducible(tmp_path, monkeypatch):
    for out in ("a", "b"):
        run_script(
            "make_jpeg_imagefolder",
            monkeypatch,
            "--out",
            str(tmp_path / out),
            "--train",
            "4",
            "--val",
            "2",
            "--classes",
            "2",
            "--workers",
            "1",
        )
    files = digests(tmp_path / "a")
    assert files == digests(tmp_path / "b")
    with pytest.raises(SystemExit, match="a is not empty; choose a new folder"):
        run_script("make_jpeg_imagefolder", monkeypatch, "--out", str(tmp_path / "a"), "--train", "1", "--val", "0")
    assert digests(tmp_path / "a") == files
    assert sorted(files) == [
        "train/class000/000000.jpg",
        "train/class000/000002.jpg",
        "train/class001/000001.jpg",
        "train/class001/000003.jpg",
        "val/class000/000000.jpg",
        "val/class001/000001.jpg",
    ]
    for name in files:
        with Image.open(tmp_path / "a" / name) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert 300 <= min(image.size) <= 500 and 3 / 4 - 0.01 <= image.size[0] / image.size[1] <= 4 / 3 + 0.01


def test_shard_images_writes_every_split_and_says_how_to_train(tmp_path, monkeypatch, capsys):
    run_script(
        "shard_images",
        monkeypatch,
        "--root",
        str(REPO / "data" / "digits"),
        "--out",
        str(tmp_path / "s"),
        "--samples-per-shard",
        "600",
    )
    printed = capsys.readouterr().out
    assert "train: 1438 samples of 10 classes in 3 shards (train-000000.tar ...)" in printed
    assert "val: 359 samples of 10 classes in 1 shards" in printed and f"data.root={tmp_path / 's'}" in printed
    with pytest.raises(SystemExit, match="^2$"):
        run_script("shard_images", monkeypatch, "--root", str(REPO / "data" / "digits"), "--out", str(tmp_path / "s"))
    assert (
        capsys.readouterr().err == f"error: {tmp_path / 's'} exists and is not an empty folder; choose a new folder\n"
    )
    with pytest.raises(SystemExit):
        run_script(
            "shard_images",
            monkeypatch,
            "--root",
            str(REPO / "data" / "digits"),
            "--out",
            str(tmp_path / "t"),
            "--samples-per-shard",
            "0",
        )


def chat_answers(messages: list[dict]) -> list[str]:
    """The assistant turns data/chat_sanity/README.md's rules give for the conversation's user turns."""
    import re

    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    answers, first = [], None
    for message in messages:
        if message["role"] != "user":
            continue
        q = message["content"]
        if m := re.fullmatch(r"What is (\d+) \+ (\d+)\?", q):
            total = int(m[1]) + int(m[2])
            answer, result, first = f"{m[1]} + {m[2]} = {total}", str(total), total
        elif m := re.fullmatch(r"Now add (\d)\.", q):
            answer, result = f"{first} + {m[1]} = {first + int(m[1])}", str(first + int(m[1]))
        elif m := re.fullmatch(r"Reverse the word (\w+)\.", q):
            answer, result = f"{m[1]} reversed is {m[1][::-1]}", m[1][::-1]
        elif m := re.fullmatch(r"Write in capitals: (\w+ \w+)", q):
            answer, result = f"In capitals: {m[1].upper()}", m[1].upper()
        elif m := re.fullmatch(r"How many letters are in (\w+)\?", q):
            answer, result = f"{m[1]} has {len(m[1])} letters", str(len(m[1]))
        elif m := re.fullmatch(r"Sort these words: (\w+ \w+ \w+)", q):
            answer = result = " ".join(sorted(m[1].split()))
            answer = f"In order: {answer}"
        else:
            m = re.fullmatch(r"Spell (\w+) with dashes\.", q)
            answer, result = f"{m[1]} spelled: {'-'.join(m[1])}", "-".join(m[1])
        answers.append(
            result
            if system == "Reply with the result only."
            else answer.upper()
            if "capital" in (system or "")
            else answer
        )
    return answers


def test_the_shipped_chat_set_is_what_the_script_makes_and_follows_its_rules(tmp_path, monkeypatch):
    import json

    run_script("make_chat_sanity", monkeypatch, "--out", str(tmp_path / "chat"))
    shipped = REPO / "data" / "chat_sanity"
    assert digests(tmp_path / "chat") == {k: v for k, v in digests(shipped).items() if k.endswith(".jsonl")}
    assert sum(p.stat().st_size for p in shipped.iterdir()) < 300_000
    shapes = set()
    for split in ("train", "val"):
        for line in (shipped / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            messages = row.get("messages") or [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["response"]},
            ]
            assert [m["content"] for m in messages if m["role"] == "assistant"] == chat_answers(messages), line
            shapes.add(("pair" if "prompt" in row else messages[0]["role"], len(messages) > 3))
    assert shapes >= {("pair", False), ("system", False), ("system", True), ("user", False), ("user", True)}
