"""deploykit.models: the model table, offline Lite0 weights, the torchvision download path on a
file:// URL, --weights, user factories and --input-shape."""

from __future__ import annotations

import hashlib
import re
import shutil

import numpy as np
import pytest

import deploykit.models as models_mod
from deploykit.compare import topk_accuracy
from deploykit.data.images import list_images, load_image_rgb, normalize, preprocess_image
from deploykit.errors import StageError, UsageError
from deploykit.layout import DEFAULT_DATA
from deploykit.models import (
    build_model, IMAGENET_MEAN, model_spec, parse_input_shape, parse_input_shapes,
)


DATA = DEFAULT_DATA


# ----------------------------------------------------------------------------- models
def test_model_table_preprocessing():
    lite = model_spec("efficientnet_lite0")
    assert lite.mean == lite.std == (0.5, 0.5, 0.5)
    mb = model_spec("mobilenet_v3_small")
    assert mb.mean == IMAGENET_MEAN and (mb.resize, mb.crop) == (256, 224)
    assert model_spec("resnet50").resize == 232  # from torchvision's weights metadata
    with pytest.raises(UsageError):
        model_spec("not_a_model")


def test_efficientnet_lite0_offline_weights_are_real():
    """The position-wise load must give the published model, not a shuffled one: on 64 real
    images the top-1 is far above chance."""
    model, spec = build_model("efficientnet_lite0")
    import torch

    files = sorted(DATA.glob("*.JPEG"))[::16][:64]
    items = dict(list_images(DATA)[0])
    x = np.stack([preprocess_image(load_image_rgb(f), spec.resize, spec.crop,
                                          spec.interpolation) for f in files])
    with torch.inference_mode():
        logits = model(torch.from_numpy(normalize(x, spec.mean, spec.std))).numpy()
    acc = topk_accuracy(logits, np.array([items[f.name] for f in files]))
    assert acc["top1"] > 70.0


def _fake_torchvision_weights(tmp_path, monkeypatch):
    """A local file standing in for the download: a random-init mobilenet_v3_small state dict
    named with its own sha256 prefix (torch.hub checks it)."""
    import torch
    import torchvision

    sd = torchvision.models.mobilenet_v3_small().state_dict()
    blob = tmp_path / "blob.pth"
    torch.save(sd, blob)
    sha = hashlib.sha256(blob.read_bytes()).hexdigest()
    served = tmp_path / "srv" / f"mobilenet_v3_small-{sha[:8]}.pth"
    served.parent.mkdir()
    shutil.move(blob, served)
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(models_mod, "torchvision_weights_file",
                        lambda name: (served.as_uri(), hub / "checkpoints" / served.name))
    return sd, served, hub


def test_torchvision_download_path_with_local_url(tmp_path, monkeypatch):
    """The real download code (torch.hub.load_state_dict_from_url, hash check) on a file:// URL;
    the second build reads the cache without the URL."""
    import torch

    sd, served, hub = _fake_torchvision_weights(tmp_path, monkeypatch)
    model, _ = build_model("mobilenet_v3_small")
    assert (hub / "checkpoints" / served.name).exists()
    k = "features.0.0.weight"
    assert torch.equal(model.state_dict()[k], sd[k])
    served.unlink()  # now only the cache can provide it
    model2, _ = build_model("mobilenet_v3_small")
    assert torch.equal(model2.state_dict()[k], sd[k])


def test_download_failure_says_how_to_proceed(tmp_path, monkeypatch):
    import torch

    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(models_mod, "torchvision_weights_file",
                        lambda name: ((tmp_path / "missing-0123abcd.pth").as_uri(),
                                      hub / "checkpoints" / "missing-0123abcd.pth"))
    with pytest.raises(StageError) as e:
        build_model("mobilenet_v3_small")
    msg = str(e.value)
    assert str(hub / "checkpoints") in msg and "--weights" in msg and "efficientnet_lite0" in msg


def test_weights_flag_loads_local_checkpoint(tmp_path):
    import torch
    import torchvision

    sd = torchvision.models.mobilenet_v3_small().state_dict()
    torch.save({"state_dict": sd}, tmp_path / "ck.pth")
    model, _ = build_model("mobilenet_v3_small", weights=tmp_path / "ck.pth")
    assert torch.equal(model.state_dict()["classifier.3.bias"], sd["classifier.3.bias"])
    with pytest.raises(UsageError):
        build_model("mobilenet_v3_small", weights=tmp_path / "nope.pth")


def other_net():
    import torch

    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_factory_that_raises_is_named():
    with pytest.raises(StageError, match=r"factory tests\.custom_models\."
                                                r"raising_factory\(\) raised RuntimeError"):
        build_model("tests.custom_models:raising_factory")


def test_negative_or_zero_input_shape_is_a_usage_error():
    for bad in ("x:1,-3,224,224", "x:0,3"):
        with pytest.raises(UsageError, match="every dimension must be >= 1"):
            parse_input_shapes([bad])


def test_weights_folder_is_a_usage_error(tmp_path):
    (tmp_path / "model.pth").write_bytes(b"")
    with pytest.raises(UsageError, match=r"is a folder.*found there: model\.pth"):
        build_model("tests.custom_models:tiny_net", weights=tmp_path)


def test_state_dict_of_another_architecture_custom_and_torchvision(tmp_path):
    import torch

    ck = tmp_path / "other.pth"
    torch.save(other_net().state_dict(), ck)
    with pytest.raises(StageError, match=r"does not fit --model tests\.custom_models"
                                                r":tiny_net: .*of another shape.*another architecture"):
        build_model("tests.custom_models:tiny_net", weights=ck)
    with pytest.raises(StageError, match=r"does not fit --model mobilenet_v3_small: "
                                                r"\d+ tensors missing"):
        build_model("mobilenet_v3_small", weights=ck)


def test_one_input_shape_parser_for_every_stage():
    """Stages 1-3 and 6 read --input-shape with one parser: quoted names holding ':', dtypes,
    'x' or ',' between dims, and a clear error for dims < 1."""
    assert parse_input_shapes(["x:2,3,8,8", "'ids:0':1x16:int64", "4,3"]) == [
        ("x", (2, 3, 8, 8), "float32"), ("ids:0", (1, 16), "int64"), ("input_2", (4, 3), "float32")]
    assert parse_input_shape("input:0:1x3x32x32") == ("input:0", (1, 3, 32, 32), None)
    with pytest.raises(UsageError, match="every dimension must be >= 1"):
        parse_input_shapes(["x:0,3,8,8"])
    with pytest.raises(UsageError, match="unknown dtype"):
        parse_input_shapes(["x:1,3:floaty"])


# ----------------------------------------------------------------------------- timm names
def test_timm_name_takes_timms_eval_preprocessing():
    """``--model resnet10t`` (a timm name torchvision does not have) is a classifier with timm's
    eval transform: crop = input size, resize = floor(crop / crop_pct), its interpolation."""
    import timm

    from deploykit.models import model_spec

    cfg = timm.models.get_pretrained_cfg("resnet10t")
    spec = model_spec("resnet10t")
    assert spec.source == "timm" and spec.classifier
    assert spec.crop == cfg.input_size[-1] == 176
    assert spec.resize == int(176 / cfg.crop_pct) == 201
    assert spec.interpolation == cfg.interpolation and spec.mean == tuple(cfg.mean)
    assert model_spec("resnet18").source == "torchvision"  # torchvision wins a shared name
    with pytest.raises(UsageError, match="a timm model"):
        model_spec("no_such_net_anywhere")


def test_timm_name_with_a_local_checkpoint_and_offline(tmp_path, monkeypatch):
    """A local state dict is loaded (and checked: another architecture's is refused); without
    one and without network the error says how to proceed offline."""
    import huggingface_hub.constants
    import torch

    from deploykit.errors import StageError
    from deploykit.models import build_model

    ref, _ = build_model("resnet10t", pretrained=False)
    ckpt = tmp_path / "resnet10t.pth"
    torch.save(ref.state_dict(), ckpt)
    model, spec = build_model("resnet10t", weights=ckpt)
    k = "fc.weight"
    assert torch.equal(model.state_dict()[k], ref.state_dict()[k]) and not model.training
    other = tmp_path / "other.pth"
    torch.save(torch.nn.Linear(3, 2).state_dict(), other)
    with pytest.raises(StageError):
        build_model("resnet10t", weights=other)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(StageError, match="--weights PATH to a local state dict for resnet10t"):
        build_model("resnet10t")


# ----------------------------------------------------------------------------- your own model
# Tiny factories for package.module:factory: they live in a module this test writes, so each
# case builds its own model.
_FACTORIES = '''
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


def timm_like():
    m = Head(1000)
    m.pretrained_cfg = {"input_size": (3, 40, 40), "crop_pct": 0.8, "interpolation": "bicubic",
                        "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    return m


def timm_like_ten_classes():
    m = timm_like()
    m.fc = nn.Linear(4, 10)
    return m


def tv_like():
    import torchvision
    m = Head(1000)
    m.transforms = torchvision.transforms._presets.ImageClassification(
        crop_size=48, resize_size=56)
    return m


def plain():
    return Head(1000)


def two_inputs():
    class Two(nn.Module):
        def forward(self, image, depth):
            return image.mean((1, 2, 3)) + depth.mean((1, 2, 3))
    return Two()


class Buggy(Head):
    def forward(self, x):
        raise ValueError("unsupported mode 'foo'")


def buggy():
    m = Buggy(1000)
    m.pretrained_cfg = {"mean": (0.5,) * 3, "std": (0.25,) * 3, "input_size": (3, 40, 40),
                        "crop_pct": 0.8, "interpolation": "bicubic"}
    return m


def wrong_features():
    class Wrong(Head):
        def forward(self, x):
            return self.fc(x.mean((2, 3))[:, :2])  # 2 features into a Linear(4, ...)
    return Wrong(1000)
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "userfac.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PREPROCESS", raising=False)
    models_mod.custom_spec.cache_clear()
    models_mod._factory_model.cache_clear()
    yield "userfac"
    models_mod.custom_spec.cache_clear()
    models_mod._factory_model.cache_clear()


def test_factory_carrying_timm_pretrained_cfg_is_an_imagenet_classifier(factories):
    spec = model_spec("userfac:timm_like")
    assert spec.classifier and spec.preprocessing_from == "timm pretrained_cfg"
    # timm's eval transform: resize floor(40 / 0.8) = 50, crop 40
    assert (spec.resize, spec.crop, spec.interpolation) == (50, 40, "bicubic")
    assert spec.mean == (0.5,) * 3 and spec.std == (0.25,) * 3
    # build_model gives its own copy of the factory's model
    m1, _ = build_model("userfac:timm_like")
    m2, _ = build_model("userfac:timm_like")
    assert m1 is not m2


def test_factory_with_torchvision_transforms_and_without_preprocessing(factories):
    spec = model_spec("userfac:tv_like")
    assert spec.classifier and (spec.resize, spec.crop) == (56, 48)
    assert spec.preprocessing_from == "torchvision transforms"
    plain = model_spec("userfac:plain")
    assert not plain.classifier and "no preprocessing carried" in plain.preprocessing_from
    # ten outputs: a preprocessing, but no ImageNet classifier
    ten = model_spec("userfac:timm_like_ten_classes")
    assert not ten.classifier and "gives 10 outputs" in ten.preprocessing_from


def test_preprocess_makes_a_factory_an_imagenet_classifier(factories, monkeypatch):
    monkeypatch.setenv("PREPROCESS", "mean=0.485,0.456,0.406 std=0.229,0.224,0.225,crop=32")
    spec = model_spec("userfac:plain")
    assert spec.classifier and spec.preprocessing_from == "--preprocess"
    assert (spec.resize, spec.crop, spec.interpolation) == (36, 32, "bilinear")
    # stated for a model that does not map one image to 1000 logits: refused, with the way out
    with pytest.raises(UsageError, match="give your own samples with --inputs"):
        model_spec("userfac:two_inputs")


def test_a_forward_that_raises_on_one_image_is_named_not_taken_for_a_non_classifier(
        factories, monkeypatch):
    """--preprocess on a model whose forward() raised was refused with "one image gives no
    single [1, C] output, not ImageNet's 1000 logits: drop --preprocess": the exception and the
    user's line were lost. One probe cannot tell an input the model does not take from a bug in
    its code, whatever the exception's type (timm's ViT asserts its size; a None head raises a
    TypeError): a usage error (2) that names the exception, the line and all three ways out."""
    monkeypatch.setenv("PREPROCESS", "mean=0.5,std=0.5,crop=32")
    for factory, kind in (("buggy", "ValueError: unsupported mode 'foo'"),
                          ("wrong_features", "RuntimeError: ")):
        with pytest.raises(UsageError) as e:
            model_spec(f"userfac:{factory}")
        msg = str(e.value)
        assert f"forward() raises on one [1, 3, 32, 32] image ({kind}" in msg, msg
        assert re.search(r"\) at userfac\.py:\d+\. If the model reads another image size", msg)
        assert "crop=N; now 32" in msg and "--inputs" in msg
        assert re.search(r"fix it \(the line at userfac\.py:\d+\) and rerun", msg), msg
        assert "\n" not in msg
    # carried preprocessing, nothing stated: not a classifier, and the note says why
    monkeypatch.delenv("PREPROCESS")
    models_mod.custom_spec.cache_clear()
    spec = model_spec("userfac:buggy")
    assert not spec.classifier
    assert "forward() raises on one [1, 3, 40, 40] image (ValueError" in spec.preprocessing_from


@pytest.mark.parametrize("text, match", [
    ("std=0.5", "mean missing"),
    ("mean=0.5,std=0", "must be > 0"),
    ("mean=0.5,std=0.5,crop=300,resize=256", "crop 300 > resize 256"),
    ("mean=0.5,std=0.5,interpolation=lanczos", "interpolation lanczos"),
    ("mean=0.5,0.4,std=0.5", "1 or 3 finite values"),
    ("mean=0.5,std=0.5,size=3", "unknown key 'size'"),
])
def test_parse_preprocess_refuses_with_the_reason(text, match):
    with pytest.raises(UsageError, match=match):
        models_mod.parse_preprocess(text)


def test_parse_preprocess_defaults_and_one_value_per_channel():
    pp = models_mod.parse_preprocess("mean=0.5, std=0.5")
    assert pp == {"mean": (0.5,) * 3, "std": (0.5,) * 3, "resize": 256, "crop": 224,
                  "interpolation": "bilinear"}


def test_preprocess_flag_is_the_env_var_in_every_stage(factories, monkeypatch):
    """--preprocess on a stage's command line sets $PREPROCESS for that process (cli.cli)."""
    import argparse
    import os

    from deploykit.cli import add_shared_args, cli

    monkeypatch.setenv("PREPROCESS", "")  # recorded: the teardown removes what cli() sets
    monkeypatch.delenv("PREPROCESS")

    def parser():
        return add_shared_args(argparse.ArgumentParser(), "model")
    seen = {}
    monkeypatch.setattr("sys.argv", ["x", "--model", "userfac:plain", "--preprocess",
                                     "mean=0.5,std=0.5,crop=32"])
    cli(parser, lambda a: seen.update(spec=model_spec(a.model), env=os.environ["PREPROCESS"]))
    assert seen["spec"].classifier and seen["env"] == "mean=0.5,std=0.5,crop=32"


def test_factory_module_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """A stage script run from the user's folder (its sys.path starts at the repository) finds
    the factory's module there, as run_all.sh does."""
    import sys

    (tmp_path / "herefac.py").write_text(_FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delenv("PREPROCESS", raising=False)
    models_mod.custom_spec.cache_clear()
    models_mod._factory_model.cache_clear()
    try:
        assert model_spec("herefac:timm_like").classifier
    finally:
        models_mod.custom_spec.cache_clear()
        models_mod._factory_model.cache_clear()


def test_random_init_is_the_same_model_in_every_stage_and_leaves_the_rng_alone():
    """Stage 1 and stage 2 each build the --random-init model: unseeded, stage 2 exported
    another model than the reference (an FP32 ORT row then failed with cosine -0.05)."""
    import torch

    from deploykit.models import build_model

    for name in ("resnet10t", "resnet18"):  # timm, torchvision
        torch.manual_seed(123)
        state = torch.get_rng_state()
        a, _ = build_model(name, pretrained=False)
        b, _ = build_model(name, pretrained=False)
        assert torch.equal(torch.get_rng_state(), state)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_float64_input_is_named_as_a_dtype_problem_with_the_cast():
    """A float64 .npz was blamed on the first layer's channels."""
    import torch

    from deploykit.errors import UsageError
    from deploykit.model_errors import forward_error

    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    for dtype, wide in ((np.float64, True), (np.float32, False)):
        x = np.zeros((2, 1 if not wide else 3, 8, 8), dtype)  # float32: a real channel error
        try:
            m(torch.from_numpy(x))
        except RuntimeError as e:
            err = forward_error("my:f", m, {"x": x}, e, flag="--inputs")
        assert isinstance(err, UsageError)
        assert ("input x (float64) is wider than the model's parameters: cast it "
                "(x.astype(np.float32)) in --inputs" in str(err)) == wide
        assert ("expects 3 channels on axis 1" in str(err)) == (not wide)


def test_a_garbage_weights_file_is_one_short_line(tmp_path):
    """torch's own message ran over several lines and advised weights_only=False."""
    from deploykit.errors import StageError
    from deploykit.models import _load_checkpoint

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x08\x01not a checkpoint" * 10)
    with pytest.raises(StageError) as e:
        _load_checkpoint(bad)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "weights_only` set to `False`" not in msg
    assert msg.endswith("--weights takes a state dict saved with "
                        "torch.save(model.state_dict(), PATH)")


def test_the_spec_run_all_hands_its_stages_is_taken_only_for_its_model_and_preprocess(
        monkeypatch):
    """PIPELINE_MODEL_SPEC (run_all.sh computes a spec once): a stage takes it for that model
    and $PREPROCESS without importing anything (the factory named here does not exist); for
    another model, another $PREPROCESS or a malformed value it computes the spec itself."""
    from deploykit.models import SPEC_ENV, ModelSpec, model_spec, spec_from_env, spec_json

    spec = ModelSpec("nopkg.nomod:build", "custom", (0.1, 0.2, 0.3), (0.4, 0.5, 0.6), 160, 128,
                     "bicubic", classifier=True, preprocessing_from="timm pretrained_cfg")
    monkeypatch.delenv("PREPROCESS", raising=False)
    monkeypatch.setenv(SPEC_ENV, spec_json(spec))
    assert model_spec("nopkg.nomod:build") == spec  # nothing imported: the module is not there
    assert spec_from_env("other.mod:build") is None
    monkeypatch.setenv("PREPROCESS", "mean=0.5,0.5,0.5,std=0.5,0.5,0.5")
    assert spec_from_env("nopkg.nomod:build") is None  # the spec was made without it
    with pytest.raises(UsageError, match="nopkg"):
        model_spec("nopkg.nomod:build")
    monkeypatch.delenv("PREPROCESS")
    monkeypatch.setenv(SPEC_ENV, "{not json")
    assert spec_from_env("nopkg.nomod:build") is None
