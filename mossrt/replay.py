"""``mossrt replay``: a JSON script that drives a whole multi-turn streaming session.

Paths are relative to the script; unknown keys and wrong types are refused with the field's name.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator


class ReplayTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_text: StrictStr = ""
    user_audio_codes: StrictStr | None = None   # .npy [frames, K >= 16]
    user_audio_wav: StrictStr | None = None     # any audio file soundfile reads
    assistant_deltas: list[StrictStr] | None = None
    assistant_token_ids: list[StrictInt] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "ReplayTurn":
        if (self.assistant_deltas is None) == (self.assistant_token_ids is None):
            raise ValueError("give exactly one of assistant_deltas / assistant_token_ids")
        if self.user_audio_codes and self.user_audio_wav:
            raise ValueError("give user_audio_codes or user_audio_wav, not both")
        return self


class ReplayScript(BaseModel):
    model_config = ConfigDict(extra="forbid")

    voice_codes: StrictStr | None = None
    voice_wav: StrictStr | None = None
    turns: list[ReplayTurn] = Field(min_length=1, max_length=1000)

    @model_validator(mode="after")
    def _one_voice(self) -> "ReplayScript":
        if self.voice_codes and self.voice_wav:
            raise ValueError("give voice_codes or voice_wav, not both")
        return self


def load_script(path: Path) -> ReplayScript:
    """Parse and validate a replay script; ValueError names the file and the broken fields."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read the script ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: the script is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    try:
        return ReplayScript.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'script'}: {err['msg']}"
                             for err in e.errors()[:6])
        raise ValueError(f"{path}: {problems}") from None
