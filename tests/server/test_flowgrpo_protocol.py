"""``server.flowgrpo_protocol``: Flow-GRPO's reward clients against a real loopback ``rlgen serve-reward``.

The clients are rebuilt here step by step as Flow-GRPO's ``flow_grpo/rewards.py`` runs them
(``geneval_score``, ``deqa_score_remote``, ``unifiedreward_score_remote``): uint8 NHWC pixels split
with ``np.array_split``, each image saved as a PIL default-quality JPEG, the request dict pickled with
``pickle.dumps`` (Python's default protocol) and POSTed with a ``requests`` session that retries 500s,
the reply read with ``pickle.loads``. Hostile pickles (code, depth and size bombs, huge lengths, truncated
streams, random bytes, gadgets spliced into a valid request) get 400/413 and never run.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import random
import struct
from collections import defaultdict

import msgpack
import numpy as np
import pytest
import requests
import torch
from PIL import Image
from requests.adapters import HTTPAdapter, Retry

from rlgen_cli.geneval_rules import Detection
from rlgen_cli.rewards import build_reward
from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.geneval import GenEvalReward
from rlgen_cli.server.flowgrpo import GENEVAL_TAGS, OTHER_TAG
from tests.server.helpers import MeanReward, http, metric

DOG_LEFT = (10.0, 40.0, 40.0, 60.0)  # x0, y0, x1, y1 in a 100×100 image


class OneRedDog:
    """Stand-in detector: one dog in every image (GenEval's colour classifier below calls it red)."""

    def detect(self, images):
        return [[Detection("dog", DOG_LEFT, 0.95)] for _ in images]


class AllRed:
    def classify(self, image, objects, classname):
        return ["red" for _ in objects]


class PromptLength:
    """Score = number of characters of the prompt (shows which prompt reached the reward)."""

    name = "length"

    def score(self, batch: RewardBatch) -> RewardResult:
        return RewardResult(scores=torch.tensor([float(len(p)) for p in batch.prompts]))


COLORS = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}], "prompt": "a red dog"}
TWO = {
    "tag": "two_object",
    "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}],
    "prompt": "a photo of a dog and a cat",
}
OTHER = {"tag": "unlisted", "include": [{"class": "dog", "count": 1}], "prompt": "a dog"}


# ------------------------------------------------------------------ Flow-GRPO's client, step by step
def _session() -> requests.Session:
    """Flow-GRPO's session: retries 500s on every method (it allows 1000 tries, backoff 1 s; two here,
    so that a failing test fails at once)."""
    session = requests.Session()
    session.trust_env = False  # loopback: no proxy from the environment
    retry = Retry(total=2, backoff_factor=0, status_forcelist=[500], allowed_methods=False)
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return session


def _jpeg_batches(images: torch.Tensor, batch_size: int) -> list[list[bytes]]:
    """(B, 3, H, W) floats → uint8 NHWC → np.array_split into ceil(B / batch_size) → PIL JPEG bytes."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy().transpose(0, 2, 3, 1)
    batches = []
    for batch in np.array_split(pixels, np.ceil(len(pixels) / batch_size)):
        files = []
        for image in batch:
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="JPEG")
            files.append(buffer.getvalue())
        batches.append(files)
    return batches


def _geneval_client(url: str, images, metadatas, only_strict: bool, batch_size: int = 64):
    """Flow-GRPO's ``geneval_score``: per batch, pickle {images, meta_datas, only_strict}, concatenate
    the score lists and merge the per-tag dicts."""
    session = _session()
    scores, rewards, strict, groups, strict_groups = [], [], [], [], []
    metadata_batches = np.array_split(metadatas, np.ceil(len(metadatas) / batch_size))
    for files, metadata in zip(_jpeg_batches(images, batch_size), metadata_batches, strict=True):
        data = {"images": files, "meta_datas": list(metadata), "only_strict": only_strict}
        reply = pickle.loads(session.post(url, data=pickle.dumps(data), timeout=120).content)
        scores += reply["scores"]
        rewards += reply["rewards"]
        strict += reply["strict_rewards"]
        groups.append(reply["group_rewards"])
        strict_groups.append(reply["group_strict_rewards"])

    def merged(dicts):
        out = defaultdict(list)
        for d in dicts:
            for key, values in d.items():
                out[key].extend(values)
        return dict(out)

    return scores, rewards, strict, merged(groups), merged(strict_groups)


def _outputs_client(url: str, images, prompts=None, batch_size: int = 64) -> list[float]:
    """Flow-GRPO's ``deqa_score_remote`` (``prompts=None``: {images}) or ``unifiedreward_score_remote``
    ({images, prompts}: its prompts are an ``np.array_split`` chunk); reads ``outputs``."""
    session = _session()
    outputs: list[float] = []
    prompt_batches = np.array_split(prompts, np.ceil(len(prompts) / batch_size)) if prompts else None
    for i, files in enumerate(_jpeg_batches(images, batch_size)):
        data = {"images": files} if prompts is None else {"images": files, "prompts": prompt_batches[i]}
        response = session.post(url, data=pickle.dumps(data), timeout=120)
        if response.status_code != 200:
            return response
        outputs += pickle.loads(response.content)["outputs"]
    return outputs


def _images(n: int, size: int = 100) -> torch.Tensor:
    return torch.stack([torch.full((3, size, size), (40 + 30 * i) / 255) for i in range(n)])


# ------------------------------------------------------------------------------------------ protocol
@pytest.fixture
def geneval(serve):
    reward = GenEvalReward(OneRedDog(), AllRed())
    return serve({"geneval": reward}, flowgrpo_protocol=True)


@pytest.mark.parametrize("only_strict", [False, True])
def test_flowgrpo_geneval_client_gets_the_reply_its_server_builds(geneval, only_strict):
    metas = [COLORS, TWO, OTHER, COLORS, TWO]
    # batch_size 2: three requests, so the client's concatenation and per-tag merge are exercised too
    scores, rewards, strict, groups, strict_groups = _geneval_client(
        geneval.url, _images(5), metas, only_strict, batch_size=2
    )
    # a red dog: every term right (1); dog + cat: the dog counts, the cat is missing (½); unlisted tag: 1
    assert scores == [1.0, 0.5, 1.0, 1.0, 0.5]
    correct = [1.0, 0.0, 1.0, 1.0, 0.0]
    assert rewards == ([0.0] * 5 if only_strict else correct)  # only_strict: that server skips accuracy
    assert strict == correct
    x = OTHER_TAG
    expected = {tag: [x] * 5 for tag in GENEVAL_TAGS}  # 'unlisted' is not a GenEval tag: no list of its own
    expected["colors"] = [1.0, x, x, 1.0, x]
    expected["two_object"] = [x, 0.0, x, x, 0.0]
    assert strict_groups == expected
    if only_strict:
        expected["colors"] = [0.0, x, x, 0.0, x]
    assert groups == expected
    assert all(type(v) is float for v in scores + rewards + strict)


def test_rlgens_own_flowgrpo_client_reads_the_reply(geneval):
    client = build_reward("flowgrpo_remote", endpoints=[geneval.url], allow_pickle=True, backoff_s=0.01)
    out = client.score(RewardBatch(prompts=["a", "b"], images=_images(2), metadata=[COLORS, TWO]))
    assert out.scores.tolist() == [1.0, 0.5]
    assert out.details["tag"] == ["colors", "two_object"]
    assert out.details["strict_rewards"].tolist() == [1.0, 0.0]


def test_flowgrpo_deqa_client_reads_outputs(serve):
    server = serve({"brightness": build_reward("brightness")}, flowgrpo_protocol=True)  # image-only
    outputs = _outputs_client(server.url, _images(3, size=16))
    # flat grey images survive JPEG exactly: DC-only blocks of a value the quantiser keeps
    assert outputs == pytest.approx([40 / 255, 70 / 255, 100 / 255], abs=1.5 / 255)


def test_rlgens_flowgrpo_client_sends_the_prompts(serve):
    server = serve({"length": PromptLength()}, flowgrpo_protocol=True)
    client = build_reward("flowgrpo_remote", endpoints=[server.url], allow_pickle=True, retries=0)
    batch = RewardBatch(prompts=["a photo of a cat", "two dogs"], images=_images(2, size=8))
    assert client.score(batch).scores.tolist() == [16.0, 8.0]


class ImageOnlyLength(PromptLength):
    """PromptLength declared image-only: scored against the empty prompt a DeQA request implies."""

    reads_prompts = False


def test_a_request_without_prompts_is_refused_for_a_reward_that_reads_them(serve):
    rewards = {
        "length": PromptLength(),
        "brightness": build_reward("brightness"),
        "declared": ImageOnlyLength(),
    }
    server = serve(rewards, flowgrpo_protocol=True)
    files = _jpeg_batches(_images(2, size=8), 64)[0]

    status, error = http("POST", server.url + "/length", pickle.dumps({"images": files}))
    assert status == 400 and "reward 'length' scores each image against its prompt" in error["error"]
    assert "images [0, 1] have no meta_datas 'prompt'; send 'prompts'" in error["error"]
    half = pickle.dumps({"images": files, "meta_datas": [{"prompt": "abc"}, {}]})
    status, error = http("POST", server.url + "/length", half)
    assert status == 400 and "images [1] have no meta_datas 'prompt'" in error["error"]
    both = pickle.dumps({"images": files, "meta_datas": [{"prompt": "abc"}, {"prompt": "de"}]})
    assert pickle.loads(_session().post(server.url + "/length", data=both).content)["scores"] == [3.0, 2.0]

    for image_only in ("brightness", "declared"):  # DeQA's client sends images alone: fine for these
        reply = _session().post(server.url + f"/{image_only}", data=pickle.dumps({"images": files}))
        assert reply.status_code == 200, reply.text
    assert pickle.loads(reply.content)["scores"] == [0.0, 0.0]


def test_unifiedreward_client_prompts_must_be_a_list_not_a_numpy_array(serve):
    server = serve({"length": PromptLength()}, flowgrpo_protocol=True)
    prompts = ["a cat", "a big red dog"]
    refused = _outputs_client(server.url, _images(2, size=8), prompts)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "numpy" in error and "tolist()" in error
    files = _jpeg_batches(_images(2, size=8), 64)[0]
    body = pickle.dumps({"images": files, "prompts": np.array(prompts).tolist()})
    reply = pickle.loads(_session().post(server.url, data=body, timeout=30).content)
    assert reply["outputs"] == [5.0, 13.0] and reply["scores"] == [5.0, 13.0]


def test_paths_pick_the_reward_and_the_protocol_is_off_by_default(serve):
    body = pickle.dumps({"images": _jpeg_batches(_images(1, 8), 64)[0], "prompts": ["abc"]})
    both = serve({"length": PromptLength(), "mean": MeanReward()}, flowgrpo_protocol=True)
    status, error = http("POST", both.url + "/", body)
    assert status == 404 and "POST Flow-GRPO requests to /<reward>" in error["error"]
    assert pickle.loads(_session().post(both.url + "/length", data=body).content)["outputs"] == [3.0]
    status, error = http("POST", both.url + "/nope", body)
    assert status == 404 and "unknown reward 'nope'" in error["error"]

    off = serve({"length": PromptLength()})
    for path in ("/", "/length"):
        status, error = http("POST", off.url + path, body)
        assert status == 404 and error["error"].startswith(f"Not Found (POST {path})")
    status, info = http("GET", off.url + "/v1/rewards")
    assert info["flowgrpo_protocol"] is False


def test_native_limits_apply_to_pickle_requests(serve):
    server = serve(
        {"mean": MeanReward()}, flowgrpo_protocol=True, max_request_mb=0.05, max_image_pixels=32 * 32
    )
    big = pickle.dumps({"images": [os.urandom(60_000)]})
    status, error = http("POST", server.url, big)
    assert status == 413 and "server.max_request_mb" in error["error"]
    status, error = http("POST", server.url, pickle.dumps({"images": _jpeg_batches(_images(1, 40), 64)[0]}))
    assert status == 413 and "server.max_image_pixels" in error["error"]
    status, error = http("POST", server.url, pickle.dumps({"images": [b"GIF89a" + bytes(20)]}))
    assert status == 415
    deep: dict = {}
    for _ in range(40):
        deep = {"x": deep}
    body = pickle.dumps({"images": _jpeg_batches(_images(1, 8), 64)[0], "meta_datas": [deep]})
    status, error = http("POST", server.url, body)
    assert status == 413 and "server.max_metadata_depth" in error["error"]
    for body, message in [
        (pickle.dumps({"images": [b"x"], "extra": 1}), "unknown fields ['extra']"),
        (pickle.dumps({"images": ["not bytes"]}), "images[0] has type str"),
        (pickle.dumps({"images": [b"x"], "meta_datas": []}), "meta_datas has 0 entries but images has 1"),
        (pickle.dumps({"images": [b"x"], "only_strict": 1}), "'only_strict' must be a bool"),
        (pickle.dumps(["images"]), "must hold a dict, got list"),
    ]:
        status, error = http("POST", server.url, body)
        assert status == 400 and message in error["error"], (message, error)


# ------------------------------------------------------------------------------------------ hostile
class _Planted:
    """A pickle that would create ``path`` if it were ever loaded by ``pickle``."""

    def __init__(self, call, *args) -> None:
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _hostile(marker: str) -> list[tuple[str, bytes, int]]:
    """(name, body, expected status): pickles that run code, bomb the parser or break the stream."""
    touch = f"touch {marker}"
    code = [
        ("os_system", pickle.dumps(_Planted(os.system, touch))),
        ("exec", pickle.dumps(_Planted(exec, f"open({marker!r}, 'w')"))),
        ("eval_protocol0", pickle.dumps(_Planted(eval, f"open({marker!r}, 'w')"), protocol=0)),
        (
            "nested_in_request",
            pickle.dumps({"images": [b"x"], "meta_datas": [{"a": _Planted(os.system, touch)}]}),
        ),
        ("numpy_array", pickle.dumps({"images": [b"x"], "prompts": np.array(["a"])})),
        ("build", b"\x80\x04}\x94(\x8c\x01a\x94K\x01ub."),  # BUILD on a dict
        ("inst", b"(i__builtin__\nexec\n."),
        ("obj", b"\x80\x02(cos\nsystem\no."),
        ("newobj", b"\x80\x02cbuiltins\nobject\n)\x81."),
        ("ext1", b"\x80\x02\x82\x01."),
        ("persid", b"P1\n."),
        ("binpersid", b"\x80\x02K\x01Q."),
        ("set", pickle.dumps({1, 2})),
        ("bytearray", pickle.dumps(bytearray(b"ab"), protocol=5)),
        ("proto2_bytes", pickle.dumps({"images": [b"x"]}, protocol=2)),
    ]
    bombs = [
        ("list_depth", b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b"."),
        ("tuple_depth", b"\x80\x04K\x01" + b"\x85" * 100_000 + b"."),
        ("mark_flood", b"\x80\x04" + b"(" * 3_000_000 + b"."),
        ("none_pop_flood", b"\x80\x04" + b"N0" * 1_500_000 + b"N."),
        (
            "memo_laughs",
            b"\x80\x04]K\x01a\x94" + b"".join(b"0](h%ch%ce\x94" % (i, i) for i in range(40)) + b".",
        ),
        ("many_items", pickle.dumps({"images": [], "meta_datas": [0] * 300_000})),
        ("self_cycle", b"\x80\x04]\x94h\x00a."),
        ("sealed_cycle", b"\x80\x04]\x94}\x94K\x01h\x00sa."),
    ]
    big = (1 << 63) - 1
    lengths = [
        ("binbytes8_2^63", b"\x80\x04\x8e" + struct.pack("<Q", big) + b"."),
        ("binunicode8_2^63", b"\x80\x04\x8d" + struct.pack("<Q", big) + b"."),
        ("binbytes_4g", b"\x80\x04B" + struct.pack("<I", 0xFFFFFFFF) + b"."),
        ("long4_2g", b"\x80\x04\x8b" + struct.pack("<i", 0x7FFFFFFF) + b"."),
        ("long4_negative", b"\x80\x04\x8b" + struct.pack("<i", -5) + b"."),
        ("frame_2^63", b"\x80\x04\x95" + struct.pack("<Q", big) + b"N."),
        ("binget_missing", b"\x80\x04j" + struct.pack("<I", 7) + b"."),
    ]
    statuses = {name: 413 for name, _ in bombs} | {"self_cycle": 400, "sealed_cycle": 400}
    out = [(n, b, 400) for n, b in code + lengths] + [(n, b, statuses[n]) for n, b in bombs]
    valid = pickle.dumps({"images": _jpeg_batches(_images(2, 8), 64)[0], "meta_datas": [COLORS, TWO]})
    out += [(f"truncated_{k}", valid[:k], 400) for k in (0, 1, 2, 11, len(valid) // 2, len(valid) - 1)]
    return out


def _fuzzed(valid: bytes, gadgets: list[bytes], rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """Random bytes, random opcode soups, and gadgets spliced into a valid request at random offsets."""
    opcodes = [op.code.encode("latin-1") for op in pickletools.opcodes]
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            body = rng.randbytes(rng.randrange(1, 300))
        elif kind == 1:
            body = b"\x80\x04" + b"".join(
                rng.choice(opcodes) + rng.randbytes(rng.randrange(0, 4)) for _ in range(40)
            )
        else:
            at = rng.randrange(2, len(valid) - 1)
            body = valid[:at] + rng.choice(gadgets) + valid[at:]
        out.append((f"fuzz_{i}_{kind}", body))
    return out


def test_hostile_pickles_never_run_and_get_400_or_413(serve, tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the server must never call pickle's own unpickler")

    marker = tmp_path / "PWNED"
    server = serve({"mean": MeanReward()}, flowgrpo_protocol=True)
    valid = pickle.dumps({"images": _jpeg_batches(_images(2, 8), 64)[0], "meta_datas": [COLORS, TWO]})
    cases = _hostile(str(marker))
    gadgets = [body[2:-1] for name, body, _ in cases[:4]] + [b"cos\nsystem\n", b"R", b"b", b"\x93", b"\x81"]
    cases += [(name, body, None) for name, body in _fuzzed(valid, gadgets, random.Random(35), 240)]
    for name in ("loads", "load", "Unpickler", "_loads", "_Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    wrong = []
    for name, body, expected in cases:
        status, error = http("POST", server.url, body)
        if (status not in (400, 413) if expected is None else status != expected) or "error" not in error:
            wrong.append(f"{name}: {status} {error}")
    assert not wrong, "\n".join(wrong[:20])
    assert not marker.exists()
    status, _ = http("GET", server.url + "/healthz")
    assert status == 200
    _, text = http("GET", server.url + "/metrics")
    assert metric(text, 'rlgen_errors_total{kind="internal"}') == 0
    monkeypatch.undo()
    reply = pickle.loads(_session().post(server.url, data=valid, timeout=30).content)
    assert len(reply["scores"]) == 2


def test_hostile_errors_name_what_was_refused(serve):
    server = serve({"mean": MeanReward()}, flowgrpo_protocol=True)
    expectations = {
        "os_system": "opcode STACK_GLOBAL",
        "inst": "opcode INST",
        "eval_protocol0": "opcode GLOBAL",
        "set": "opcode EMPTY_SET",
        "mark_flood": "opcodes",
        "memo_laughs": "server.max_request_items",
        "list_depth": "server.max_metadata_depth",
        "binbytes8_2^63": "declares 9223372036854775807 bytes",
        "proto2_bytes": "'_codecs.encode'",
        "truncated_11": "truncated",
    }
    cases = {name: body for name, body, _ in _hostile("/nonexistent/never")}
    for name, needle in expectations.items():
        _, error = http("POST", server.url, cases[name])
        assert needle in error["error"], (name, error)


def test_a_pickle_and_msgpack_of_the_same_data_count_the_same_items(serve):
    """The item cap means the same on both wires: a body just at it passes, one item more is refused."""
    metas = [{"k": [1, 2, 3], "tag": "x"}] * 2
    files = _jpeg_batches(_images(2, 8), 64)[0]
    payload = {"images": files, "meta_datas": metas}
    # hand count: map 1 + 2 entries; images list 1 + 2; meta_datas list 1 + 2; each meta map 1 + 2
    # entries and its list 1 + 3 → 3 + 3 + 3 + 2 × 7 = 23 (a shared meta, memo-referenced, counts again)
    native = {"reward": "mean", "images": files, "prompts": ["a", "b"], "metadata": metas}
    headers = {"Content-Type": "application/msgpack"}
    for limit, status in [(23, 200), (22, 413)]:
        image_only = {"brightness": build_reward("brightness")}  # no prompts in the pickle: DeQA-like
        server = serve(image_only, flowgrpo_protocol=True, max_request_items=limit)
        assert _session().post(server.url, data=pickle.dumps(payload)).status_code == status
        # the native body holds two more entries (reward, prompts) and the prompts list (1 + 2): 23 + 5
        server = serve({"mean": MeanReward()}, max_request_items=limit + 5)
        reply = _session().post(server.url + "/v1/score", data=msgpack.packb(native), headers=headers)
        assert reply.status_code == status
