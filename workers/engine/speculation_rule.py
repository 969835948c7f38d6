"""When proposals pay: speculative decoding's measured rule for proposing in a step or not.

Proposals cost rows, and a draft model's own steps. `SpeculationRule` fits the
target's time for a step that only decodes against its rows (a least-squares
line, T(R) = a + b·R, over the recent such steps: a prompt's rows cost far
less each) and the proposer's time against the sequences asked (another
line), and measures the tokens proposed per sequence asked and the share of
them accepted, ρ. With B sequences drawing, D proposals that took P seconds
to make yield ρ·D more tokens for b·D + P more seconds: they raise the tokens
per second when ρ·D·T(B) > B·(b·D + P). (A step's prompt rows are left out:
proposals riding along a prompt's rows would look cheap, and those rows'
cost is not on the line.) A step where proposals would not pay proposes
nothing (as at large batches, or with a draft that costs about what the
target does). So that both kinds of step stay measured, while proposals pay
one step in 16 proposes nothing, and while they do not one sequence proposes
after 16 steps, then 32, 64, up to 256 (one: a draft model catching up the
tokens it missed makes such a step dear). Each switch is logged with its
figures. `--speculative-always` has every step propose, as vLLM and TGI do.
"""

from __future__ import annotations

import structlog

log = structlog.get_logger(__name__)

_PROBE_EVERY = 16  # steps: while proposals pay, one in this many proposes nothing; while not, the first probe's wait
_PROBE_MOST = 256  # steps: while proposals do not pay, the wait between probes doubles up to this
_DECAY = 0.95  # per step, of the lines' sums and of the measured shares: about the last 20 steps weigh
_FIT_STEPS = 8  # steps measured before a cost line is trusted


class CostLine:
    """Seconds against a count (a step's rows; the sequences a proposer was asked for), seconds = a + b·rows,
    fitted by least squares over the recent steps (each step's weight decays by _DECAY per step after it)."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # decayed: steps, rows, seconds, rows², rows·seconds

    def add(self, rows: int, seconds: float) -> None:
        observed = (1.0, rows, seconds, rows * rows, rows * seconds)
        self._sums = [_DECAY * total + value for total, value in zip(self._sums, observed, strict=True)]

    def fit(self) -> tuple[float, float] | None:
        """(a, b), each at least 0; None until _FIT_STEPS steps are in, and their rows have varied."""
        steps, rows, seconds, squares, products = self._sums
        if steps < (1 - _DECAY**_FIT_STEPS) / (1 - _DECAY) - 1e-9:  # the decayed count of _FIT_STEPS steps
            return None
        variance = squares / steps - (rows / steps) ** 2
        if variance < 1e-6:
            return None
        slope = max(0.0, (products / steps - rows / steps * seconds / steps) / variance)
        return max(0.0, seconds / steps - slope * rows / steps), slope

    def at(self, rows: int) -> float:
        """The seconds a step of `rows` rows takes: on the fitted line, or while there is none, in proportion
        to the rows (0 before any step)."""
        line = self.fit()
        if line is not None:
            return line[0] + line[1] * rows
        _, total_rows, seconds = self._sums[:3]
        return seconds / total_rows * rows if total_rows else 0.0


def proposals_pay(
    acceptance: float, line: tuple[float, float] | None, drawing: int, proposals: float, proposing_s: float
) -> bool:
    """Whether `proposals` tokens, made in `proposing_s` seconds and accepted at the share `acceptance`, raise
    the tokens per second of a step where `drawing` sequences decode, when the target's step of R rows costs
    line = (a, b): a + b·R seconds.

    The step yields drawing + acceptance·proposals tokens in a + b·(drawing + proposals) + proposing_s
    seconds, against drawing tokens in a + b·drawing: more per second iff
    acceptance·proposals·(a + b·drawing) > drawing·(b·proposals + proposing_s). Unmeasured (None), they are
    taken to pay.
    """
    if line is None:
        return True
    return acceptance * proposals * (line[0] + line[1] * drawing) > drawing * (line[1] * proposals + proposing_s)


class SpeculationRule:
    """Whether a step proposes, and for how many sequences, from what the recent steps measured."""

    def __init__(self, num_tokens: int, always: bool = False) -> None:
        """`always`: every speculating sequence proposes in every step, measured or not (--speculative-always)."""
        self._always = always
        self.cost = CostLine()  # the target's decode-only steps
        self.proposing = CostLine()  # the proposer's seconds against the sequences asked
        # Decayed over the steps that proposed; optimistic until measured:
        self.acceptance = 1.0  # the share of proposals accepted
        self.proposal_length = float(num_tokens)  # tokens proposed per sequence asked
        self._on = True  # whether proposals paid at the last step
        self._steps = 0  # since the last switch or probe
        self._probe_wait = _PROBE_EVERY  # steps between probes while proposals do not pay
        self._step_proposed = self._step_accepted = 0

    def asking(self, drawing: int, speculating: int) -> int:
        """How many of the `speculating` sequences of `drawing` propose this step: all where proposals pay, none
        where not, except for the probes that keep both kinds of step measured (the module's docstring). A probe
        where proposals do not pay asks one sequence, whose catching up is all a draft does. A change of mind
        is logged."""
        if not speculating or self._always:
            return speculating
        line = self.cost.fit()
        proposals = self.proposal_length * speculating
        proposing_s = self.proposing.at(speculating)
        pays = proposals_pay(self.acceptance, line, drawing, proposals, proposing_s)
        if pays != self._on:
            self._on, self._steps, self._probe_wait = pays, 0, _PROBE_EVERY
            log.info(
                "speculation_switched",
                on=pays,
                acceptance=round(self.acceptance, 3),
                step_s=round(line[0], 6) if line else None,
                row_s=round(line[1], 7) if line else None,
                proposing_s=round(proposing_s, 6),
                proposals=round(proposals, 1),
                drawing=drawing,
            )
        self._steps += 1
        if self._steps < self._probe_wait:
            return speculating if pays else 0
        self._steps = 0
        if pays:
            return 0
        self._probe_wait = min(2 * self._probe_wait, _PROBE_MOST)
        return 1

    def proposed(self, asked: int, made: int, seconds: float) -> None:
        """`asked` sequences were asked for proposals: `made` tokens came, in `seconds`."""
        self.proposal_length = _DECAY * self.proposal_length + (1 - _DECAY) * made / asked
        self.proposing.add(asked, seconds)

    def settled(self, proposed: int, accepted: int) -> None:
        """One sequence's proposals were verified: `accepted` of `proposed` taken."""
        self._step_proposed += proposed
        self._step_accepted += accepted

    def measured(self, rows: int | None, seconds: float) -> None:
        """The target computed a step in `seconds`: the acceptance learns from it, and the cost line from a step
        of `rows` decoding rows (None: a step with prompt chunks, whose rows cost otherwise)."""
        if rows is not None:
            self.cost.add(rows, seconds)
        if self._step_proposed:
            share = self._step_accepted / self._step_proposed
            self.acceptance = _DECAY * self.acceptance + (1 - _DECAY) * share
        self._step_proposed = self._step_accepted = 0
