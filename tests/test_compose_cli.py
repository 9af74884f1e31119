"""`h3-spark generate` composing: films past one generation, shots, continued clips and guides, end to end on
the built-in tiny synthetic models; and every bad composition refused in one line before any weight loads."""

import json
import math

import numpy as np
import pytest
import torch

from h3_spark.cli import main
from h3_spark.h3_model.media import files as media

pytest.importorskip("av")

TINY = ["--width", "64", "--height", "64", "--steps", "2"]


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


def _generate(capsys, demo_models, *argv):
    code = main(["generate", "--demo", "--demo-dir", str(demo_models), *TINY, *argv])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return json.loads(cap.out.strip().splitlines()[-1])


def _clip(path, frames, seed=0, audio=True):
    pixels = torch.randint(0, 256, (frames, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    sound = None
    if audio:
        t = torch.arange(round(frames / 24 * 32000)) / 32000
        sound = torch.stack([torch.sin(2 * math.pi * 330 * t)] * 2) * 0.5
    media.write_mp4(path, pixels, sound)
    return path


def test_a_film_past_one_generation_is_made_in_windows(demo_models, tmp_path, capsys):
    out = tmp_path / "film.mp4"
    summary = _generate(capsys, demo_models, "--seconds", "16", "--out", str(out))
    assert summary["frames"] == 384 and summary["audio_samples"] == summary["audio_samples_expected"] == 512000
    assert [w["film_frames"] for w in summary["windows"]] == [[0, 192], [192, 384]]
    assert [w["overlap_trimmed"] for w in summary["windows"]] == [0, 1]
    info = media.probe(out)
    assert info["frames"] == 384 and info["audio_duration"] == pytest.approx(16.0, abs=1e-3)


@pytest.mark.parametrize("argv", [["--recipe", "turbo"], ["--cache-mode", "easycache", "--steps", "6"]])
def test_a_recipe_or_a_step_cache_runs_in_every_window(argv, demo_models, tmp_path, capsys, monkeypatch):
    from h3_spark.h3_model.engine.engine import Engine

    requests = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, req, *a, **k: requests.append(req) or real(self, req, *a, **k))
    code = main(["generate", "--demo", "--demo-dir", str(demo_models), "--width", "64", "--height", "64",
                 "--seconds", "16", *argv, "--out", str(tmp_path / "film.mp4")])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert len(summary["windows"]) == len(requests) == 2 and summary["exact"] is False
    if argv[0] == "--recipe":
        assert summary["recipes"][0]["name"] == "turbo" and "recipe turbo" in summary["approximate_paths"]
        assert all(r.recipes[0]["name"] == "turbo" and (r.steps, r.video_shift) == (9, 6.0) for r in requests)
    else:  # a fresh cache per window: its state belongs to one generation
        assert requests[0].step_cache is not requests[1].step_cache
        assert all("step_cache" in w for w in summary["windows"]) and "step_cache" in summary["approximate_paths"]


def test_shots_each_start_afresh(demo_models, tmp_path, capsys):
    out = tmp_path / "shots.mp4"
    summary = _generate(capsys, demo_models, "--shot", "1:a fox runs", "--shot", "1.5:a crow lands", "--out",
                        str(out))
    assert summary["frames"] == 60 and [w["shot"] for w in summary["windows"]] == [0, 1]
    assert [w["history_frames"] for w in summary["windows"]] == [0, 0]
    assert media.probe(out)["frames"] == 60


def test_a_continued_clip_comes_first_and_goes_on(demo_models, tmp_path, capsys):
    clip = _clip(tmp_path / "clip.mp4", 48)
    out = tmp_path / "more.mp4"
    summary = _generate(capsys, demo_models, "--continue", str(clip), "--seconds", "1", "--out", str(out))
    assert summary["continued_frames"] == 48 and summary["frames"] == 72
    assert summary["windows"][0]["history_frames"] == 22 and summary["windows"][0]["overlap_trimmed"] == 1
    info = media.probe(out)
    assert info["frames"] == 72 and info["audio_duration"] == pytest.approx(3.0, abs=1e-3)


def _wav(path, seconds):
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=32000, layout="stereo")
        samples = int(seconds * 32000)
        frame = av.AudioFrame.from_ndarray((np.random.default_rng(1).uniform(-0.5, 0.5, (1, 2 * samples)) * 32767)
                                           .astype(np.int16), format="s16", layout="stereo")
        frame.sample_rate = 32000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def test_guides_from_files(demo_models, tmp_path, capsys):
    from PIL import Image

    still = tmp_path / "still.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(still)
    clip = _clip(tmp_path / "guide.mp4", 22, seed=2, audio=False)
    sound = _wav(tmp_path / "sound.wav", 0.5)
    out = tmp_path / "guided.mp4"
    summary = _generate(capsys, demo_models, "--guide", f"image:{still}@48", "--guide", f"clip:{clip}@-22",
                        "--guide", f"audio:{sound}@0", "--out", str(out))
    assert summary["frames"] == 124
    # 3 guides: a still (one latent frame), a clip (7) and half a second of sound (20 latents, 2 channels) add
    # (1 + 7) x 4 + 40 rows to the 124-frame T2VA sequence of the same prompt.
    plain = _generate(capsys, demo_models, "--out", str(tmp_path / "plain.mp4"))
    assert summary["sequence_length"] - plain["sequence_length"] == 8 * 4 + 40


@pytest.mark.slow
def test_ref2va_with_three_guides_the_multiframe_reference_template(demo_models, tmp_path, capsys, monkeypatch):
    """ComfyUI's multiframe reference template: one reference picture (the identity) and three guides at 1.5, 3
    and 5 s (frames 36, 72, 120 of 124), a whole tiny generation. The guides' rows come after the text, before
    the reference, at the target's time for their frames (the text and the reference's slot, then 5/3 a frame)."""
    from PIL import Image

    from h3_spark.h3_model.pipeline.generation import Pipeline

    pictures = []
    for i in range(4):
        pictures.append(tmp_path / f"h3_frame_ref_{i + 1}.png")
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(pictures[-1])
    layouts = []
    real = Pipeline.sample
    monkeypatch.setattr(Pipeline, "sample", lambda self, dit, request, *a, **k: layouts.append(request.layout)
                        or real(self, dit, request, *a, **k))
    argv = ["--ref", f"image:{pictures[0]}", "--prompt", "<Picture 1> walks through three shots"]
    guided = _generate(capsys, demo_models, *argv, "--guide", f"image:{pictures[1]}@36", "--guide",
                       f"image:{pictures[2]}@72", "--guide", f"image:{pictures[3]}@120", "--out",
                       str(tmp_path / "multiframe.mp4"))
    plain = _generate(capsys, demo_models, *argv, "--out", str(tmp_path / "plain.mp4"))
    assert guided["mode"] == "ref2va" and guided["frames"] == 124 and media.probe(tmp_path / "multiframe.mp4")["frames"] == 124
    grid = 4  # 64x64: a 4x4 latent, 2x2 patches a frame
    assert guided["sequence_length"] - plain["sequence_length"] == 3 * grid
    lay, bare = layouts
    pos, text = lay.position_ids, int(lay.text_indices.numel())
    origin = pos[lay.target_video_indices[0], 0].item()
    assert origin == text + 1.0 == bare.position_ids[bare.target_video_indices[0], 0].item()
    for i, frame in enumerate((36, 72, 120)):
        assert torch.all(pos[text + i * grid:text + (i + 1) * grid, 0] == origin + 5.0 / 3.0 * frame)
    assert torch.equal(pos[text + 3 * grid:], bare.position_ids[text:])  # the reference and the target, unmoved
    assert lay.num_condition_video_rows == 4 * grid


def test_repaint_a_region_and_a_span(demo_models, tmp_path, capsys):
    from PIL import Image

    clip = _clip(tmp_path / "clip.mp4", 124)
    region = np.zeros((64, 64, 3), dtype=np.uint8)
    region[:32, :32] = 255  # one 32-pixel patch of four
    Image.fromarray(region).save(tmp_path / "mask.png")
    summary = _generate(capsys, demo_models, "--repaint", str(clip), "--mask", str(tmp_path / "mask.png"),
                        "--out", str(tmp_path / "region.mp4"))
    # 37 latent frames x 4 patches: one patch of each frame made anew; the sound (207 latents x 2) kept.
    assert summary["kept_rows"] == {"video": 37 * 3, "audio": 414} and summary["frames"] == 124
    summary = _generate(capsys, demo_models, "--repaint", str(clip), "--regenerate-seconds", "1-2", "--out",
                        str(tmp_path / "span.mp4"))
    assert summary["kept_rows"]["video"] == 29 * 4  # frames 24..47 touch latent frames 7..14


@pytest.mark.parametrize("argv,message", [
    (["--mask", "still.png"], "--mask and --regenerate-seconds go with --repaint CLIP.mp4"),
    (["--repaint", "clip.mp4"], "--repaint needs what to make anew: --mask, --regenerate-seconds or both"),
    (["--repaint", "clip.mp4", "--regenerate-seconds", "1"], "--regenerate-seconds must be START-END in seconds"),
    (["--repaint", "clip.mp4", "--mask", "still.png"], "--mask still.png is 8x8; the clip is 64x64"),
    (["--repaint", "clip.mp4", "--regenerate-seconds", "0-1"],
     "the clip to repaint has 30 frames; it must be 17k+5 (124..345)"),
    (["--seconds", "200"], "a film lasts more than 0 and at most 120 s, got 200"),
    (["--guide-strength", "1.5"], "guide strength is the level conditions are held at, in (0, 1] (0.999 as released), got 1.5"),
    (["--guide", "photo:a.png@3"], "--guide must be KIND:PATH@FRAME with KIND in image, clip, audio, got 'photo:a.png@3'"),
    (["--guide", "image:a.png"], "--guide must be KIND:PATH@FRAME"),
    (["--guide", "image:a.png@x"], "--guide 'image:a.png@x': the frame after @ must be an integer, got 'x'"),
    (["--shot", "five:a fox"], "--shot must be SECONDS:PROMPT, got 'five:a fox'"),
    (["--shot", "1:a", "--shots", "s.json"], "--shot and --shots both give the shots: use one"),
    (["--shots", "bad.json"], "--shots bad.json is not valid JSON"),
    (["--shots", "dict.json"], "--shots dict.json must hold a JSON list of shots, got dict"),
    (["--shots", "long.json"], "the shots last 130 s; a film lasts at most 120 s"),
    (["--continue", "clip.mp4"], "--continue needs the new part's length: --seconds, --shot or --shots"),
    (["--continue", "sound.wav", "--seconds", "2"], "sound.wav: unsupported video type .wav; use .mp4, .mov, .webm"),
    (["--continue", "voice.mp4", "--seconds", "2"], "voice.mp4: no video stream"),
    (["--continue", "clip.mp4", "--seconds", "2", "--width", "128", "--height", "64"],
     "--continue clip.mp4 is 64x64; the request asks for 128x64: a clip is continued at its own size"),
    (["--seconds", "20", "--first-frame", "still.png"],
     "a film past one generation is made of t2va windows; fl2va takes one generation of at most 345 frames"),
    (["--seconds", "20", "--history-frames", "20"], "history frames must be 17k+5 (5, 22, 39, ...), got 20"),
    (["--repaint", "clip124.mp4", "--regenerate-seconds", "6-7"],
     "the span 6..7 s starts past the clip's end (5.16667 s)"),
    # Guides: judged against the clip's length and canvas, which the flags give.
    (["--guide", "image:still.png@124"],
     "guide 1 (image): frame 124 is outside the 124-frame clip (use 0..123, or -1..-124 from the end)"),
    (["--frames", "141", "--guide", "image:still.png@-142"], "guide 1 (image): frame -142 is outside the 141-frame clip"),
    (["--guide", "clip:clip.mp4@0"],
     "guide 1 (clip) has 30 frames at 24 fps; a clip guide is 17k+5 frames (5, 22, 39, ...) (the nearest shorter is 22)"),
    (["--guide", "clip:clip22.mp4@110"],
     "guide 1 (clip): its 22 frames from frame 110 run past the clip's end (124 frames); anchor it at 102 or earlier"),
    (["--guide", "image:strip.png@0"],
     "guide 1 (image) is 64x8: cover-cropped to the 64x64 canvas it would keep 12.5% of its width"),
    (["--guide", "image:still.png@0", "--guide", "audio:sound.wav@3"], "sound.wav: cannot read as audio"),
    (["--ref", "image:still.png", "--prompt", "<Picture 1> walks", "--guide", "image:still.png@124"],
     "guide 1 (image): frame 124 is outside the 124-frame clip"),
    (["--first-frame", "wide.png", "--guide", "image:tall.png@0"],  # FL2VA's canvas follows its first frame: 4:1
     "guide 1 (image) is 8x16: cover-cropped to the 2016x512 canvas it would keep 12.7% of its height"),
    (["--seconds", "20", "--guide", "image:strip.png@400"],  # the film's second window holds frame 400
     "window 2 (film frames 242..485): guide 1 (image) is 64x8: cover-cropped to the 64x64 canvas"),
    (["--seconds", "20", "--guide", "clip:clip22.mp4@230"], "guide 1 (clip): its 22 frames from frame 230 cross a "
                                                            "window boundary"),
])
def test_bad_compositions(argv, message, capsys, tmp_path, monkeypatch):
    """Each refused in one line before the engine is made: no component is looked for, no weight read (a spy in
    the engine's place fails the test if it is reached)."""
    from PIL import Image

    from h3_spark.h3_model.engine import engine

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("[{\"seconds\": 1,")
    (tmp_path / "dict.json").write_text("{\"seconds\": 1}")
    (tmp_path / "long.json").write_text(json.dumps([{"seconds": 65, "prompt": "a"}, {"seconds": 65, "prompt": "b"}]))
    (tmp_path / "sound.wav").write_bytes(b"RIFF")
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8) + 9).save(tmp_path / "still.png")
    Image.fromarray(np.zeros((8, 64, 3), dtype=np.uint8) + 9).save(tmp_path / "strip.png")
    Image.fromarray(np.zeros((8, 32, 3), dtype=np.uint8) + 9).save(tmp_path / "wide.png")
    Image.fromarray(np.zeros((16, 8, 3), dtype=np.uint8) + 9).save(tmp_path / "tall.png")
    _clip(tmp_path / "clip.mp4", 30)
    _clip(tmp_path / "clip22.mp4", 22, audio=False)
    _clip(tmp_path / "clip124.mp4", 124)
    _sound_only(tmp_path / "voice.mp4")
    made = _spy_engine(monkeypatch, engine)
    size = [] if "--first-frame" in argv or "--continue" in argv or "--repaint" in argv else ["--width", "64",
                                                                                             "--height", "64"]
    code = main(["generate", "--prompt", "p", "--out", "o.mp4", "--models", str(tmp_path), *size, *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert made == []


def _spy_engine(monkeypatch, engine):
    """The engine replaced by a spy that records being made and refuses to go on: no weight can be read."""
    made = []

    def spy(self, *args, **kwargs):
        made.append(args)
        raise AssertionError("the engine was made: weights would be read")

    monkeypatch.setattr(engine.Engine, "__init__", spy)
    return made


def test_the_engine_spy_sees_flags_that_pass(capsys, tmp_path, monkeypatch):
    """The spy of test_bad_compositions is reached once the flags pass (so a refusal made after loading would
    fail that test), and a sound guide past the clip's end is not refused but noted before the load."""
    from PIL import Image

    from h3_spark.h3_model.engine import engine

    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8) + 9).save(tmp_path / "still.png")
    _wav(tmp_path / "long.wav", 8.0)
    made = _spy_engine(monkeypatch, engine)
    with pytest.raises(AssertionError, match="the engine was made"):
        main(["generate", "--prompt", "p", "--out", "o.mp4", "--models", str(tmp_path), "--width", "64", "--height",
              "64", "--guide", "image:still.png@36", "--guide", "audio:long.wav@29"])
    assert len(made) == 1
    err = capsys.readouterr().err
    assert ("h3-spark: note: guide 2 (audio): 8.000 s of sound from frame 29 runs past the clip's end; cropped to "
            "the 158 audio latents (3.950 s) that remain") in err


def _sound_only(path):
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=32000, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.zeros((2, 32000), dtype=np.float32) + 0.1, format="fltp",
                                           layout="stereo")
        frame.sample_rate = 32000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
