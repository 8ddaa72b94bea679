"""Hugging Face datasets as a data.py source: ``--dataset hf:NAME[:CONFIG]``.

Imported only for hf: datasets, and it imports the optional extra ``datasets`` only inside
``spec`` (a missing extra is one UsageError naming `pip install datasets`). NAME is a hub id
(streamed, so nothing beyond the rows read is fetched), a folder written by ``save_to_disk``, a
local folder of data files, or one of HF_BUILDERS reading ``--hf_data_files``. Rows become
documents ``(split key, text)`` for ``text_data._build_text``, which tokenizes them, splits them by a
stable hash of the key and writes the same bins and meta.json as every other text dataset.
Offline, a hub id fails within HUB_TIMEOUT seconds with one line naming the dataset.
"""
import glob
import itertools
import os
import re
import shutil
import threading

from harness import text_data, token_files
from common import UsageError
from harness.cli import repeated

HF_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "webdataset")  # they read --hf_data_files
SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
# pandas' default missing-value list would drop texts such as "NA", "null", "None", "n/a": only an empty cell is missing
CSV_MISSING = dict(keep_default_na=False, na_values=[""])
HUB_TIMEOUT = 10.0  # seconds the Hugging Face Hub gets to answer before hf:NAME fails


def folder_name(hf):
    """hf-<name>[-<config>]: the start of the prepared folder's name."""
    name = hf["name"].strip("./")[-40:] + (f"-{hf['config']}" if hf["config"] else "")
    return "hf-" + re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def spec(dataset, split, text_field, split_key, data_files):
    """Check an hf:NAME[:CONFIG] dataset without opening it; the dict also fingerprints it.
    NAME is a hub id, a save_to_disk folder, a local folder of data files, a data file (SUFFIXES),
    or one of HF_BUILDERS (json, csv, parquet, text, ...) reading --hf_data_files. UsageError naming `pip install
    datasets` when the optional extra is missing."""
    name, _, config = dataset[3:].partition(":")
    if not name:
        raise UsageError(f"--dataset {dataset}: give hf:NAME or hf:NAME:CONFIG")
    try:
        import datasets  # noqa: F401 - the optional extra, needed only here
    except ImportError:
        raise UsageError(f"--dataset {dataset}: reading Hugging Face datasets needs the optional extra: "
                         "pip install datasets") from None
    files = [f for f in (data_files or "").split(",") if f]
    if (twice := repeated(files)) is not None:  # read twice, its rows would count twice
        raise UsageError(f"--hf_data_files {data_files}: {twice} given twice")
    if os.path.isfile(name) and not files and os.path.splitext(name)[1] in SUFFIXES:  # hf:corpus.jsonl
        name, files = SUFFIXES[os.path.splitext(name)[1]], [name]
    local = os.path.exists(name)
    if local:
        name = os.path.abspath(name)
        saved = any(os.path.exists(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json"))
        kind = "saved" if saved else "local"
    elif name in HF_BUILDERS:
        kind = "builder"
        if not files:
            raise UsageError(f"--dataset {dataset}: needs --hf_data_files FILE[,FILE...] (paths or globs)")
    elif re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        kind = "hub"
    else:
        raise UsageError(f"--dataset {dataset}: {name} is neither a local folder nor a Hugging Face hub id")
    matched = sorted({p for f in files for p in glob.glob(f, recursive=True) if os.path.isfile(p)})
    if kind == "builder" and not matched:
        raise UsageError(f"--hf_data_files {data_files}: no such file")
    within = [os.path.relpath(os.path.join(d, f), name) for d, _, fs in os.walk(name) for f in fs] if local else []
    local_files = [os.path.abspath(p) for p in matched] + [os.path.join(name, r) for r in sorted(within)]
    return dict(dataset=dataset, name=name, config=config, kind=kind, split=split, text_field=text_field,
                split_key=split_key, data_files=[os.path.abspath(f) if glob.glob(f) else f for f in files],
                local_files=[p.lstrip(os.sep) for p in local_files])


def build(tmp, hf, **text):
    """Stream the dataset's rows into text_data._build_text; every failure of `datasets` is one UsageError.
    The first row of every source is checked (columns, text type) before the tokenizer loads, and
    every later row too; rows whose text is null or empty (in a CSV table: an empty cell; "NA",
    "null", "None" are text) are dropped, and the rows read, kept and
    dropped are printed and recorded as meta["rows"] (text_data._build_text). Returns the meta
    dict; its split rule names the column that decided the splits."""
    try:
        streams = _streams(hf, cache_dir=os.path.join(tmp, ".hf_cache"))
        meta = text_data._build_text(tmp, _docs(hf, _checked(hf, streams)), hf["dataset"], "", by_key_only=True,
                                     count="n_documents", unit="rows",
                                     empty=f"--hf_text_field {hf['text_field']} null or empty", **text)
    finally:
        shutil.rmtree(os.path.join(tmp, ".hf_cache"), ignore_errors=True)
    meta["split_rule"] = (f"by document: sha256(its {hf['key_column'] or 'text'} column)[:8] as int % 100 "
                          "<90 train, <95 dev, else test (documents with equal values share a split)")
    return meta


def _streams(hf, cache_dir):
    """The dataset as a list of row iterables (one per --hf_data_files entry, read interleaved).
    Hub datasets are streamed (nothing is downloaded beyond the rows read); a hub that does not
    answer within HUB_TIMEOUT seconds is a UsageError naming the dataset."""
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        if hf["kind"] == "saved":
            ds = datasets.load_from_disk(hf["name"])
            if isinstance(ds, datasets.DatasetDict):
                if hf["split"] not in ds:
                    raise UsageError(f"--hf_split {hf['split']}: {hf['name']} has splits {', '.join(ds)}")
                ds = ds[hf["split"]]
            return [ds]
        if hf["kind"] == "hub":
            _check_hub(hf["dataset"], hf["name"])
        groups = [[f] for f in hf["data_files"]] or [None]
        return [datasets.load_dataset(hf["name"], hf["config"] or None, split=hf["split"], data_files=g,
                                      streaming=True, cache_dir=cache_dir, **_reader_options(hf, g, cache_dir))
                for g in groups]
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever `datasets` raises is bad input or no network
        raise _error(hf, e) from None


def _reader_options(hf, data_files, cache_dir):
    """The reader's keyword arguments for this source: for CSV tables (csv with --hf_data_files, or a
    local folder or hub dataset of CSV files) only empty cells are missing (CSV_MISSING); {} for the
    other readers, whose nulls are typed. A source that cannot be inspected gets {} (load_dataset
    then names what is wrong with it)."""
    if hf["kind"] == "builder":
        return dict(CSV_MISSING) if hf["name"] == "csv" else {}
    from datasets.load import dataset_module_factory
    try:
        module = dataset_module_factory(hf["name"], data_files=data_files, cache_dir=cache_dir).module_path
    except Exception:  # noqa: BLE001 - load_dataset reports it, as one UsageError (_error)
        return {}
    return dict(CSV_MISSING) if module.rsplit(".", 1)[-1] == "csv" else {}


def _error(hf, e):
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return UsageError(f"--dataset {hf['dataset']}: cannot read it ({type(e).__name__}: {first})")


def _check_hub(dataset, name):
    """UsageError within HUB_TIMEOUT seconds unless the hub answers for this dataset (skipped when
    HF_HUB_OFFLINE=1 asks for the local cache)."""
    from huggingface_hub import HfApi, constants, errors
    if constants.HF_HUB_OFFLINE:
        return
    box = []
    thread = threading.Thread(target=lambda: box.append(token_files._try(HfApi().dataset_info, name)), daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT)
    offline = ("without network use a local copy: hf:FOLDER (saved with save_to_disk) or "
               "hf:json --hf_data_files FILE")
    if not box:
        raise UsageError(f"--dataset {dataset}: no answer from the Hugging Face Hub in {HUB_TIMEOUT:g} s; {offline}")
    if isinstance(box[0], errors.RepositoryNotFoundError):
        raise UsageError(f"--dataset {dataset}: no such dataset on the Hugging Face Hub "
                         "(private or gated ones need `hf auth login`)")
    if isinstance(box[0], Exception):
        first = (str(box[0]).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"--dataset {dataset}: cannot reach the Hugging Face Hub "
                         f"({type(box[0]).__name__}: {first}); {offline}")


def _source_names(hf, n):
    """What to call each of the n streams in an error: its --hf_data_files entry, else the dataset."""
    files = hf["data_files"]
    return [files[i] if len(files) == n else hf["dataset"] for i in range(n)]


def _next(hf, it):
    """The next row of a stream (None at its end); a failing stream is one UsageError."""
    try:
        return next(it)
    except StopIteration:
        return None
    except Exception as e:  # noqa: BLE001 - a stream failing mid-way (network, bad file)
        raise _error(hf, e) from None


def _checked(hf, streams):
    """[(source name, row iterator)] with the first row of every stream already read and checked
    (_check_row), so a missing column is reported before any tokenizing; the first row of the first
    stream fixes the key column (recorded as hf["key_column"])."""
    out = []
    for name, stream in zip(_source_names(hf, len(streams)), streams):
        it = iter(stream)
        first = _next(hf, it)
        if first is None:
            continue
        if "key_column" not in hf:
            hf["key_column"] = _key_column(hf, first, name)
        _check_row(hf, first, name)
        out.append((name, itertools.chain([first], it)))
    hf.setdefault("key_column", None)
    return out


def _docs(hf, sources):
    """(split key, text) per row, the sources interleaved one row at a time; every row is checked
    (_check_row). A null or empty text is passed on (text_data._build_text drops and counts it)."""
    key = hf["key_column"]
    its = list(sources)
    while its:
        for name, it in list(its):
            row = _next(hf, it)
            if row is None:
                its.remove((name, it))
                continue
            text = _check_row(hf, row, name)
            yield (None if key is None or not text else str(row[key])), text


def _check_row(hf, row, name):
    """The row's text; UsageError naming the source (file) and the column when the row lacks the
    text or split-key column, or its text is neither null nor a string."""
    key = hf.get("key_column")
    auto = " (auto: the first source has it)" if hf["split_key"] == "auto" else ""
    for flag, col in ((f"--hf_text_field {hf['text_field']}", hf["text_field"]), (f"--hf_split_key {key}{auto}", key)):
        if col is not None and col not in row:
            raise UsageError(f"{flag}: not a column of {name} (columns: {', '.join(row)})")
    text = row[hf["text_field"]]
    if text is not None and not isinstance(text, str):
        raise UsageError(f"--hf_text_field {hf['text_field']}: holds {type(text).__name__}, not text, in {name}")
    return text


def _key_column(hf, row, name):
    """The column that decides the split (None: the text); UsageError for a missing column."""
    if hf["text_field"] not in row:
        raise UsageError(f"--hf_text_field {hf['text_field']}: not a column of {name} (columns: {', '.join(row)})")
    key = hf["split_key"]
    if key == "auto":
        return "id" if "id" in row else None
    if key == "text" or key == hf["text_field"]:
        return None
    if key not in row:
        raise UsageError(f"--hf_split_key {key}: not a column of {name} (columns: {', '.join(row)})")
    return key
