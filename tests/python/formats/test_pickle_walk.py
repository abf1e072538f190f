"""The C++ safety walk of a pickle (``_C.pickle_check``, the one walk fastckpt
runs: behind ``fastckpt.formats.unpickler.check`` and ``loads``) against the
Python walk, kept as the oracle (``_unpickle.check_reference``): the same verdict
(accepted with the same estimate, or refused with the same exception type and
message), in both modes (calls of what a call returned allowed, for torch's
unpickler; only globals called, for ``loads``), on

- every pickle of the hostile corpora (hostile_pickles.py, crafted.py, the
  data.pkl of the fuzz corpora's archives), and the tricks spliced into real
  pickles;
- pickles of real state dicts, optimizers and nested containers at protocols
  0-5 (torch.save's data.pkl, plain pickles of Python objects);
- random and mutated byte strings (hypothesis; FASTCKPT_FUZZ_EXAMPLES raises the
  count, as for the other fuzzers).

Also: the C++ walk refuses a million-deep nesting without recursing, and the
messages tests match are the ones the caller sees.
"""
import collections
import io
import os
import pickle
import struct
import warnings
import zipfile

import pytest
import torch

import fastckpt
from fastckpt.formats import unpickler as _unpickle

import crafted
import hostile_pickles as hp
from paths import DATA

EXAMPLES = int(os.environ.get("FASTCKPT_FUZZ_EXAMPLES", "300"))


def verdict(fn, data, **kw):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # genops' escape decoding warns on invalid escapes
            return ("accepted", fn(data, "f.pt: data.pkl", **kw))
    except _unpickle.Refused as e:
        return ("Refused", str(e))
    except fastckpt.FormatError as e:
        msg = str(e)
        # Damage that genops reports through a codec or int()/float(): the same
        # category, the text may differ in the detail of Python's message.
        if "damaged pickle (" in msg and any(w in msg for w in ("codec", "invalid literal", "could not convert",
                                                                  "Exceeds the limit")):
            return ("FormatError", "damaged pickle (...)")
        return ("FormatError", msg)


def _strict_c(data, where, persistent=True, max_depth=_unpickle.MAX_OBJECT_DEPTH):
    """The C++ walk as loads() runs it (only globals may be called)."""
    return _unpickle._c_walk(data, where, persistent, max_depth, call_objects=False)


def same(data, **kw):
    """check() (calls of what a call returned allowed, for torch's unpickler) and
    the walk of loads() (only globals called): C++ and Python agree on both."""
    want = verdict(_unpickle.check_reference, data, **kw)
    got = verdict(_unpickle.check, data, **kw)
    assert got == want, f"{data[:200]!r}... ({len(data)} bytes): C++ {got} != Python {want}"
    strict_want = verdict(_unpickle.check_reference, data, call_objects=False, **kw)
    strict_got = verdict(_strict_c, data, **kw)
    assert strict_got == strict_want, f"{data[:200]!r}... ({len(data)} bytes), loads' walk: C++ {strict_got} " \
        f"!= Python {strict_want}"
    return got


# ---------------------------------------------------------------- corpora

# One pickle per handler's refusal and per argument reader's damage.
EDGES = {
    "reduce_on_scalar": b"\x80\x02N)R.",
    "newobj_ex_on_string": b"\x80\x04\x8c\x01a)}\x92.",
    "setitem_on_list": b"\x80\x02]NNs.",
    "setitems_odd": b"\x80\x02}(Nu.",
    "dict_odd": b"(Nd.",
    "append_on_dict": b"\x80\x02}Na.",
    "additems_on_list": b"\x80\x04](N\x90.",
    "build_on_dict": b"\x80\x02}Nb.",
    "build_on_inst": b"\x80\x02cbuiltins\nset\n)R}b.",
    "no_mark": b"\x80\x02Nl.",
    "pop_mark_no_mark": b"\x80\x021.",
    "pop_to_mark": b"\x80\x02(0N.",
    "underflow": b"\x80\x02\x86.",
    "underflow_fence": b"\x80\x02N(\x85.",
    "dup_empty": b"2.",
    "dup": b"\x80\x02N2\x86.",
    "stack_global_not_str": b"\x80\x04NN\x93.",
    "stack_global": b"\x80\x04\x8c\x08builtins\x8c\x03set\x93)R.",
    "bad_protocol": b"\x80\x06N.",
    "stop_two": b"NN.",
    "stop_mark": b"N(.",
    "stop_empty": b".",
    "inst": b"(ibuiltins\nset\n.",
    "obj": b"(o.",
    "ext1": b"\x80\x02\x82\x01.",
    "next_buffer": b"\x80\x05\x97.",
    "unknown_opcode": b"\x80\x02\xff.",
    "exhausted": b"\x80\x02N",
    "persid": b"P1\n.",
    "persid_bad_escape": b"P\\x1\n.",
    "binpersid": b"\x80\x02NQ.",
    "memoize_empty": b"\x80\x04\x94.",
    "put_bool": b"N01\np01\n.",
    "put_bool0": b"Np00\n.",
    "put_neg": b"Np-1\n.",
    "put_big": b"Np" + b"9" * 40 + b"\n.",
    "get_bool": b"Np0\ng00\n0.",
    "get_neg": b"Np0\ng-0\n0.",
    "int_forms": b"(I 1_0 \nI+5\nI00\nI01\nI-0\nl.",
    "int_bad": b"I1__0\n.",
    "int_digits": b"I" + b"1" * 5000 + b"\n.",
    "long_forms": b"(L123L\nL-" + b"7" * 300 + b"\nL0\nl.",
    "float_forms": b"(F1.5\nF-inf\nFnan\nF1e5\nF.5\nF1_0.2_5\nF 2. \nl.",
    "float_bad": b"F1e\n.",
    "float_bad2": b"F_1\n.",
    "string_forms": b"(S'a\\x41\\101\\q\\n'\nS\"\"\nS'\nl.",
    "string_noquote": b"Sabc\n.",
    "string_oneend": b"S'abc\n.",
    "string_nonascii": b"S'\xff'\n.",
    "string_octal_high": b"S'\\377'\n.",
    "string_trailing_bs": b"S'\\'\n.",
    "unicode_forms": b"(V\\u0041\\U0001F600\\\\u0041\\x\xff\\\nl.",
    "unicode_truncated": b"V\\u12\n.",
    "unicode_range": b"V\\U00110000\n.",
    "utf8_surrogate": b"\x80\x04\x8c\x03\xed\xa0\x80.",
    "utf8_overlong": b"\x80\x04\x8c\x02\xc0\x80.",
    "utf8_truncated": b"\x80\x04\x8c\x02\xe2\x82.",
    "long1": b"\x80\x02\x8a\x09" + b"\xff" * 8 + b"\x7f.",
    "long1_neg": b"\x80\x02(\x8a\x02\x00\x80\x8a\x01\xff\x8a\x03\x00\x00\xffl.",
    "long4_neg": b"\x80\x02\x8b\xff\xff\xff\xff.",
    "string4_neg": b"T\xff\xff\xff\xff.",
    "bytes8_maxsize": b"\x80\x04\x8e" + b"\xff" * 8 + b".",
    "bytearray8": b"\x80\x05\x96\x03\x00\x00\x00\x00\x00\x00\x00abc.",
    "frame_ok": b"\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00N.",
    "frame_short": b"\x80\x04\x95\x01\x00",
    "empty": b"",
    "setitems_no_target": b"(NNu.",
    "build_no_target": b"Nb.",
    "appends_no_target": b"(Ne.",
    "self_append": b"\x80\x02]q\x00h\x00ah\x00a.",
    "call_depth": b"\x80\x02cbuiltins\nset\n" + b"]" * 150 + b"a" * 149 + b"\x85R.",
}


def _corpus():
    out = dict(hp.SIZE_ATTACKS)
    out.update(hp.AMPLIFIERS)
    out.update({f"code:{k}": v for k, v in hp.code_attacks("/nonexistent/marker").items()})
    out["huge_memo_get_spam"] = hp.huge_memo_get_spam(1 << 12)
    out["copying_calls_small"] = hp.copying_calls(200, 6)
    for d in (1, 99, 100, 101, 999, 1000, 1001, 3000):
        out[f"nested_{d}"] = crafted.nested_pickle(d)
        out[f"deep_tuple_{d}"] = hp.deep_tuple_key(d)
    for i in (0, 1, 255, 0x7FFFFFFF, 0xFFFFFFFF):
        out[f"memo_{i}"] = crafted.memo_pickle(i)
    out["wrapped"] = crafted.wrap_pickle(crafted.nested_pickle(50), crafted.tensor_pickle([("0", 4)]))
    for p in range(2, 6):
        out[f"tensor_pickle_{p}"] = crafted.tensor_pickle([("0", 4), ("1", 100)], protocol=p)
    out.update(EDGES)
    for root in ("fuzz_corpus", "fuzz_corpus_dcp"):
        for dirpath, _, files in os.walk(DATA / root):
            for f in files:
                path = os.path.join(dirpath, f)
                with open(path, "rb") as fh:
                    blob = fh.read()
                if f == ".metadata":
                    out[path] = blob
                    continue
                try:
                    with zipfile.ZipFile(io.BytesIO(blob)) as z:
                        for name in z.namelist():
                            if name.endswith("data.pkl"):
                                out[f"{path}:{name}"] = z.read(name)
                except Exception:
                    out[path] = blob  # not an archive: walk it as it is
    return out


CORPUS = _corpus()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_same_verdict(name):
    data = CORPUS[name]
    same(data)
    same(data, persistent=False)
    same(data, max_depth=_unpickle.MAX_DEPTH)


def test_corpus_has_refusals_of_every_kind():
    """The corpus exercises each refusal (so the comparison above means something)."""
    text = "\n".join(str(same(v, **kw)[1]) for v in CORPUS.values() for kw in ({}, {"persistent": False}))
    for needle in ("skips ahead", "was never stored", "bytes that follow", "nested more than",
                   "would take more than", "calls a", "damaged pickle (expected", "on a list", "odd number",
                   "no MARK", "stack underflow", "STACK_GLOBAL needs", "unsupported pickle protocol", "STOP with",
                   "opcode INST", "persistent id", "without an object"):
        assert needle in text, needle


def _base_pickles():
    """Real pickles: torch.save's data.pkl of state dicts and optimizers, plain pickles of containers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    objs = {
        "state_dict": model.state_dict(),
        "adamw": opt.state_dict(),
        "sgd": sgd.state_dict(),
        "scalars": {f"s{i}": torch.tensor(float(i)) for i in range(50)},
        "mixed": {"step": 7, "lr": 0.5, "name": "run é\u1234\U0001F600", "tags": ["a", "b"], "none": None,
                  "t": (1, 2, 3), "big": 10 ** 40, "neg": -(2 ** 70), "bytes": b"\x00\xff" * 10,
                  "od": collections.OrderedDict(a=1), "nested": [[[[{"k": (1,)}]]]], "flag": True},
    }
    out = {}
    for name, obj in objs.items():
        for proto in (2, 3, 4, 5):
            buf = io.BytesIO()
            torch.save(obj, buf, pickle_protocol=proto, _use_new_zipfile_serialization=True)
            with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
                out[f"{name}/torch.save/{proto}"] = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    plain = [1, -1, 2 ** 31, 2 ** 64, -(2 ** 100), 1.5, float("inf"), "text", "é\u1234\U0001F600", b"raw",
             bytearray(b"ba"), (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [], [1, [2, [3]]], {}, {"a": {"b": {}}},
             set(), {1, 2}, frozenset(), frozenset({3}), None, True, False,
             {"shared": (lambda x: [x, x])([1])}, collections.OrderedDict(z=1, a=[2]), slice(1, 2)]
    for proto in range(0, 6):
        out[f"plain/{proto}"] = pickle.dumps(plain, protocol=proto)
        rec = []
        rec.append(rec)
        out[f"self_ref/{proto}"] = pickle.dumps(rec, protocol=proto)
        for i, o in enumerate(plain):
            out[f"plain/{proto}/{i}"] = pickle.dumps(o, protocol=proto)
    return out


BASE = _base_pickles()


@pytest.mark.parametrize("name", sorted(BASE))
def test_real_pickles_same_verdict(name):
    v = same(BASE[name])
    if "/plain/" not in f"/{name}" and not name.startswith("self_ref"):
        assert v[0] == "accepted", v
    same(BASE[name], persistent=False)


def test_real_pickles_are_accepted():
    for name, data in BASE.items():
        assert same(data)[0] == "accepted", name


def test_tricks_spliced_into_real_pickles():
    """Each opcode trick of hostile_pickles, spliced at every opcode boundary of a real data.pkl."""
    import pickletools
    base = BASE["adamw/torch.save/2"]
    cuts = [pos for _, _, pos in pickletools.genops(base)]
    for name, trick in hp.tricks("/nonexistent/marker").items():
        for at in cuts[:: max(1, len(cuts) // 40)]:
            same(base[:at] + trick + base[at:])


# ---------------------------------------------------------------- fuzz

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_SEEDS = sorted(BASE.items())[:40]
_OPS = [bytes([c]) for c in b"(.012FIJKLMNPQRSTUVXabc}deghijl]opqrstuG"] + [bytes([c]) for c in range(0x80, 0x99)]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    same(data)
    same(b"\x80\x02" + data)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(st.sampled_from(_OPS),
                          st.sampled_from([b"\x00", b"\x01", b"\xff", b"\n", b"0\n", b"'a'\n", b"\\", b"1_0\n",
                                           b"00\n", b"01\n", b"-1\n", b"1e5\n", b"inf\n", b"\\u12\n",
                                           b"builtins\nset\n", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff"]),
                          st.binary(max_size=4)), max_size=60))
def test_fuzz_opcode_soup(parts):
    data = b"".join(parts)
    same(data)
    same(data + b".")
    same(data, persistent=False, max_depth=3)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(_SEEDS), st.data())
def test_fuzz_mutated_real_pickles(seed, draw):
    _, base = seed
    data = bytearray(base)
    for _ in range(draw.draw(st.integers(1, 4))):
        kind = draw.draw(st.integers(0, 3))
        at = draw.draw(st.integers(0, max(0, len(data) - 1)))
        if kind == 0 and data:
            data[at] = draw.draw(st.integers(0, 255))
        elif kind == 1:
            data[at:at] = draw.draw(st.sampled_from(_OPS))
        elif kind == 2 and data:
            del data[at:at + draw.draw(st.integers(1, 8))]
        else:
            data = data[:at]
    same(bytes(data))


# ---------------------------------------------------------------- the C++ walk's own bounds

def test_million_deep_nesting_refused_without_recursion():
    for data in (b"\x80\x02" + b"]" * 1_000_000 + b"a" * 999_999 + b".",
                 b"\x80\x02N" + b"\x85" * 1_000_000 + b".",
                 b"\x80\x02" + b"(" * 1_000_000 + b"." ):
        with pytest.raises(fastckpt.FormatError, match="nested more than 1000 deep|STOP with"):
            _unpickle.check(data, "deep.pkl")


def test_messages_name_the_path_and_position():
    with pytest.raises(fastckpt.FormatError, match=r"^my/f\.pt: data\.pkl: memo index 4294967295 skips ahead of "
                                                    r"the 0 entries stored so far at byte 3 of the 9-byte pickle"):
        _unpickle.check(crafted.memo_pickle(0xFFFFFFFF)[:8] + b".", "my/f.pt: data.pkl")
    with pytest.raises(_unpickle.Refused, match=r"^x: refused to unpickle: a persistent id \(none are allowed "
                                                r"here\) at byte 3; nothing from the file was run"):
        _unpickle.check(b"\x80\x02NQ.", "x", persistent=False)
    with pytest.raises(fastckpt.FormatError, match=r"^x: damaged pickle \(expected 1099511627776 bytes in a "
                                                   r"bytes8, but only 4 remain\)"):
        _unpickle.check(hp.binbytes8(), "x")


def test_check_accepts_buffers_and_returns_the_estimate():
    data = BASE["adamw/torch.save/4"]
    assert _unpickle.check(memoryview(data), "x") == _unpickle.check_reference(data, "x") > 0
