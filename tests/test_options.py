"""etl_args -> TransformOptions: every field, refusals naming the field, service defaults underneath."""

from __future__ import annotations

import json

import pytest

from transformer.config import Settings
from transformer.errors import ConfigError, OptionsError
from transformer.options import parse_etl_args
from transformer.spec import build_pipeline
from transformer.wire import ETL_ARG_FIELDS


def parse(args: object, settings: Settings):
    return parse_etl_args(json.dumps(args), settings)


def test_empty_etl_args_give_the_service_defaults(settings: Settings) -> None:
    for raw in (None, "", "  ", "{}"):
        options = parse_etl_args(raw, settings)
        assert options.pipeline is build_pipeline("imagenet-train")
        assert (options.dtype, options.layout, options.on_error, options.epoch) == ("float32", "CHW", "skip", 0)
        assert options.seeded is False and isinstance(options.seed, int)
        assert options.image_exts == settings.image_exts and options.mask_exts == settings.mask_exts
        assert options.max_member_bytes == settings.max_member_bytes
        assert options.max_image_pixels == settings.max_image_pixels
        assert options.error_manifest is True


def test_every_field(settings: Settings) -> None:
    options = parse(
        {"preset": "imagenet-val", "dtype": "float16", "layout": "HWC", "seed": 42, "epoch": 3, "on_error": "fail",
         "skip": 5, "crop_decode": False, "dct_scaling": True},
        settings,
    )
    assert options.pipeline is build_pipeline("imagenet-val")
    assert (options.dtype, options.layout, options.on_error) == ("float16", "HWC", "fail")
    assert (options.seed, options.seeded, options.epoch, options.skip) == (42, True, 3, 5)
    assert options.crop_decode is False and options.dct_scaling is True
    assert set(ETL_ARG_FIELDS) == {"preset", "transforms", "dtype", "layout", "seed", "epoch", "on_error", "skip",
                                    "crop_decode", "dct_scaling"}
    assert parse({}, settings).skip == 0


def test_crop_decode_defaults_to_the_setting_and_must_be_a_boolean(settings: Settings) -> None:
    assert parse({}, settings).crop_decode is settings.crop_decode is True
    assert parse({}, Settings.from_env({"ETL_CROP_DECODE": "false"})).crop_decode is False
    assert parse({"crop_decode": True}, Settings.from_env({"ETL_CROP_DECODE": "false"})).crop_decode is True
    for bad in ("false", 0, None):
        with pytest.raises(OptionsError) as info:
            parse({"crop_decode": bad}, settings)
        assert info.value.field == "crop_decode"


def test_dct_scaling_is_off_unless_asked_for_and_must_be_a_boolean(settings: Settings) -> None:
    assert parse({}, settings).dct_scaling is settings.dct_scaling is False
    assert parse({}, Settings.from_env({"ETL_DCT_SCALING": "true"})).dct_scaling is True
    assert parse({"dct_scaling": False}, Settings.from_env({"ETL_DCT_SCALING": "true"})).dct_scaling is False
    assert parse({"dct_scaling": True}, settings).dct_scaling is True
    for bad in ("true", 1, None):
        with pytest.raises(OptionsError) as info:
            parse({"dct_scaling": bad}, settings)
        assert info.value.field == "dct_scaling"
    with pytest.raises(ConfigError):
        Settings.from_env({"ETL_DCT_SCALING": "sometimes"})


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8"])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_dtype_and_layout_choices(settings: Settings, dtype: str, layout: str) -> None:
    options = parse({"dtype": dtype, "layout": layout}, settings)
    assert (options.dtype, options.layout) == (dtype, layout)


@pytest.mark.parametrize("policy", ["skip", "fail", "passthrough"])
def test_error_policies(settings: Settings, policy: str) -> None:
    assert parse({"on_error": policy}, settings).on_error == policy


def test_transforms_as_list_json_text_and_yaml_text(settings: Settings) -> None:
    steps = [{"Resize": {"size": 64}}, {"CenterCrop": {"size": 48}}]
    as_list = parse({"transforms": steps}, settings).pipeline
    as_json = parse({"transforms": json.dumps(steps)}, settings).pipeline
    as_yaml = parse({"transforms": "- Resize: {size: 64}\n- CenterCrop: {size: 48}"}, settings).pipeline
    assert as_list is as_json is as_yaml
    assert parse({"transforms": "resize-224"}, settings).pipeline is build_pipeline("resize-224")


@pytest.mark.parametrize("field", ["Dtype", "size", "transform", "seeds", "normalize"])
def test_unknown_field_is_refused_by_name(settings: Settings, field: str) -> None:
    with pytest.raises(OptionsError) as info:
        parse({"dtype": "uint8", field: 1}, settings)
    assert info.value.field == field
    assert "unknown field" in info.value.reason and "dtype" in info.value.reason
    assert info.value.status == 400


@pytest.mark.parametrize(
    "args, field",
    [
        ({"dtype": "float64"}, "dtype"),
        ({"dtype": 32}, "dtype"),
        ({"layout": "chw"}, "layout"),
        ({"layout": ["C", "H", "W"]}, "layout"),
        ({"on_error": "ignore"}, "on_error"),
        ({"on_error": None}, "on_error"),
        ({"seed": "42"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": "1"}, "epoch"),
        ({"epoch": False}, "epoch"),
        ({"epoch": 2.0}, "epoch"),
        ({"skip": -1}, "skip"),
        ({"skip": "3"}, "skip"),
        ({"skip": 1.0}, "skip"),
        ({"skip": True}, "skip"),
        ({"skip": None}, "skip"),
        ({"preset": 5}, "preset"),
        ({"preset": "imagenet"}, "preset"),
        ({"preset": None}, "preset"),
        ({"transforms": [{"Lambda": {}}]}, "transforms[0]"),
        ({"transforms": "[{"}, "transforms"),
        ({"transforms": 7}, "transforms"),
    ],
)
def test_bad_values_name_the_field(settings: Settings, args: dict, field: str) -> None:
    with pytest.raises(OptionsError) as info:
        parse(args, settings)
    assert info.value.field == field
    assert f"'{field}'" in info.value.message


def test_forwarded_etl_args_leave_skip_out() -> None:
    from transformer.options import forwarded_etl_args

    assert forwarded_etl_args("") == ""
    assert forwarded_etl_args('{"dtype": "uint8"}') == '{"dtype": "uint8"}'  # untouched without skip
    assert json.loads(forwarded_etl_args('{"dtype": "uint8", "skip": 4, "seed": 1}')) == {"dtype": "uint8", "seed": 1}
    assert forwarded_etl_args('{"skip": 4}') == ""


def test_preset_and_transforms_conflict(settings: Settings) -> None:
    with pytest.raises(OptionsError) as info:
        parse({"preset": "imagenet-val", "transforms": [{"Resize": {"size": 8}}]}, settings)
    assert info.value.field == "transforms" and "not both" in info.value.reason


@pytest.mark.parametrize("raw", ["[1, 2]", '"imagenet-val"', "42", "null", "{bad json", "{'dtype': 'uint8'}"])
def test_etl_args_must_be_a_json_object(settings: Settings, raw: str) -> None:
    with pytest.raises(OptionsError) as info:
        parse_etl_args(raw, settings)
    assert info.value.field == "etl_args"


def test_unseeded_requests_draw_distinct_seeds(settings: Settings) -> None:
    seeds = {parse_etl_args("{}", settings).seed for _ in range(20)}
    assert len(seeds) == 20
    assert all(0 <= s < 2**64 for s in seeds)


def test_seed_zero_and_negative_are_seeds(settings: Settings) -> None:
    assert (parse({"seed": 0}, settings).seed, parse({"seed": 0}, settings).seeded) == (0, True)
    assert parse({"seed": -5}, settings).seed == -5


def test_environment_defaults_apply_when_etl_args_omit_a_field() -> None:
    settings = Settings.from_env(
        {"ETL_PRESET": "imagenet-val", "ETL_DTYPE": "uint8", "ETL_LAYOUT": "HWC", "ETL_ON_ERROR": "passthrough",
         "ETL_SEED": "7", "ETL_ERROR_MANIFEST": "false", "ETL_MAX_MEMBER_BYTES": "1000",
         "ETL_MAX_IMAGE_PIXELS": "5000", "ETL_IMAGE_EXTS": "jpg,png", "ETL_MASK_EXTS": "seg.png"}
    )
    options = parse_etl_args("", settings)
    assert options.pipeline is build_pipeline("imagenet-val")
    assert (options.dtype, options.layout, options.on_error) == ("uint8", "HWC", "passthrough")
    assert (options.seed, options.seeded) == (7, True)
    assert options.error_manifest is False
    assert (options.max_member_bytes, options.max_image_pixels) == (1000, 5000)
    assert options.image_exts == {"jpg", "png"} and options.mask_exts == {"seg.png"}
    # etl_args override each default.
    override = parse({"preset": "resize-224", "dtype": "float32", "layout": "CHW", "on_error": "fail", "seed": 8},
                     settings)
    assert override.pipeline is build_pipeline("resize-224")
    assert (override.dtype, override.layout, override.on_error, override.seed) == ("float32", "CHW", "fail", 8)


def test_environment_transforms_override_environment_preset() -> None:
    settings = Settings.from_env({"ETL_PRESET": "imagenet-val", "ETL_TRANSFORMS": "- Resize: {size: 32}"})
    assert parse_etl_args("", settings).pipeline is build_pipeline([{"Resize": {"size": 32}}])
    # An explicit preset in etl_args still wins over the environment's transforms.
    assert parse({"preset": "imagenet-val"}, settings).pipeline is build_pipeline("imagenet-val")
