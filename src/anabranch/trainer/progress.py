"""The progress bar: step, reward, accuracy, entropy and seconds per step."""

from __future__ import annotations

from tqdm.auto import tqdm


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.bar = tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)

    def update(self, step: int, m: dict) -> None:
        post = {"reward": f"{m.get('reward/mean', 0):.3f}"}
        if "accuracy" in m:
            post["acc"] = f"{m['accuracy']:.3f}"
        post["entropy"] = f"{m.get('entropy', 0):.3f}"
        post["s/step"] = f"{m.get('time/step_s', 0):.1f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        tqdm.write(text)

    def close(self) -> None:
        self.bar.close()
