"""The textual app of `runbook top`: three tables refreshed on an interval, and
approve/reject on the selected execution with a confirmation.

The source is read in a worker thread (its HTTP calls block); a refresh that
fails keeps the last tables and says why on the status line. Keys:
`a` approve, `r` reject (then `y` to confirm, `n`/escape to cancel), `tab`
between tables, `q` quit.
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label, Static
from vllm_runbook.runbooks.model.exit_codes import RunbookError
from vllm_runbook.runbooks.operate.top.model import (
    ENGINE_COLUMNS,
    EXECUTION_COLUMNS,
    FINDING_COLUMNS,
    Snapshot,
    engine_row,
    execution_row,
    finding_row,
)
from vllm_runbook.runbooks.operate.top.sources import APPROVE, REJECT, Source

DONE = {APPROVE: "approved", REJECT: "rejected"}


class Confirm(ModalScreen[bool]):
    """Asks once: `y` does it, `n` or escape does not."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"),
        Binding("n", "answer(False)", "no"),
        Binding("escape", "answer(False)", "cancel", show=False),
    ]
    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Vertical {
        width: auto; max-width: 100; height: auto;
        border: thick $warning; background: $surface; padding: 1 2;
    }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question")
            yield Label("[b]y[/b] yes    [b]n[/b] no", id="keys")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class TopApp(App[None]):
    TITLE = "runbook top"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("a", "decide('approve')", "approve"),
        Binding("r", "decide('reject')", "reject"),
        Binding("g", "refresh_now", "refresh"),
    ]
    CSS = """
    Screen { layout: vertical; }
    .title { background: $boost; text-style: bold; padding: 0 1; }
    #engines { height: auto; max-height: 50%; }
    #findings { height: auto; max-height: 12; }
    #executions { height: auto; max-height: 12; }
    #body { height: 1fr; }
    #status { height: auto; max-height: 8; padding: 0 1; background: $panel; }
    """

    def __init__(self, source: Source, interval: float = 2.0, snapshot: Snapshot | None = None):
        super().__init__()
        self.source = source
        self.interval = interval
        self.snapshot: Snapshot | None = snapshot
        self.message = ""
        self.refreshes = 0

    def compose(self) -> ComposeResult:
        yield Static(id="header", classes="title")
        with VerticalScroll(id="body"):
            yield DataTable(id="engines", cursor_type="row", zebra_stripes=True)
            yield Static("Findings (firing)", classes="title", id="findings-title")
            yield DataTable(id="findings", cursor_type="row")
            yield Static("Executions in progress and awaiting approval", classes="title")
            yield DataTable(id="executions", cursor_type="row")
        # Above the footer, never under it: what went wrong, and the last answer.
        yield Static(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#engines", DataTable).add_columns(*ENGINE_COLUMNS)
        self.query_one("#findings", DataTable).add_columns(*FINDING_COLUMNS)
        self.query_one("#executions", DataTable).add_columns(*EXECUTION_COLUMNS)
        if self.snapshot is not None:
            self.show(self.snapshot)
        else:
            self.load()
        self.set_interval(self.interval, self.load)
        self.query_one("#executions", DataTable).focus()

    # -- refresh -------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="refresh")
    def load(self) -> None:
        try:
            snapshot = self.source.snapshot()
        except RunbookError as exc:
            self.call_from_thread(self.failed, str(exc))
            return
        self.call_from_thread(self.show, snapshot)

    def action_refresh_now(self) -> None:
        self.load()

    def failed(self, error: str) -> None:
        self.message = f"refresh failed ({datetime.now():%H:%M:%S}), showing the last: {error}"
        self._status()

    def show(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.refreshes += 1
        now = snapshot.taken_at
        up = sum(v.up for v in snapshot.engines)
        who = f"  as {self.source.who}" if self.source.who else "  read-only"
        self.query_one("#header", Static).update(
            f"runbook top — {self.source.description}{who} — "
            f"{up}/{len(snapshot.engines)} engines up — "
            f"{datetime.fromtimestamp(now):%H:%M:%S}, every {self.interval:g}s"
        )
        _fill(self.query_one("#engines", DataTable), [engine_row(v) for v in snapshot.engines])
        _fill(
            self.query_one("#findings", DataTable),
            [finding_row(f, now) for f in snapshot.findings],
        )
        executions = snapshot.executions
        _fill(
            self.query_one("#executions", DataTable),
            [execution_row(e, now) for e in executions or ()],
            keys=[str(e.id) for e in executions or ()],
        )
        self._status()

    def _status(self) -> None:
        lines = []
        if self.snapshot is not None:
            if self.snapshot.executions is None:
                lines.append("executions: no journal (give --db or --config, or --server)")
            lines += list(self.snapshot.problems)
        if self.message:
            lines.append(self.message)
        status = self.query_one("#status", Static)
        status.update("\n".join(lines))
        status.display = bool(lines)

    # -- approve / reject ---------------------------------------------------------------

    def action_decide(self, verb: str) -> None:
        table = self.query_one("#executions", DataTable)
        shown = self.snapshot.executions if self.snapshot is not None else None
        executions = {str(e.id): e for e in shown or ()}
        if not executions or table.cursor_row < 0 or table.row_count == 0:
            self.notify("no execution selected", severity="warning")
            return
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        execution = executions.get(str(key))
        if execution is None:
            return
        if not execution.awaiting:
            self.notify(
                f"execution #{execution.id} is {execution.status}, not awaiting approval",
                severity="warning",
            )
            return
        if self.source.who is None:
            self.notify(self.source.cannot_decide, severity="error")
            return
        question = (
            f"{verb.capitalize()} execution #{execution.id}: {execution.runbook} on "
            f"{execution.engine}, as {self.source.who}?"
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.send(execution.id, verb)
            else:
                self.message = f"#{execution.id}: not {DONE[verb]}"
                self._status()

        self.push_screen(Confirm(question), answered)

    @work(thread=True, group="decide")
    def send(self, execution_id: int, verb: str) -> None:
        try:
            text = self.source.decide(execution_id, verb)
        except RunbookError as exc:
            self.call_from_thread(self.decided, f"#{execution_id} not {DONE[verb]}: {exc}", False)
            return
        self.call_from_thread(self.decided, text, True)

    def decided(self, text: str, ok: bool) -> None:
        self.message = text
        self.notify(text, severity="information" if ok else "error")
        self._status()
        self.load()


def _fill(
    table: DataTable[str], rows: list[tuple[str, ...]], keys: list[str] | None = None
) -> None:
    """Replace the rows, keeping the cursor on the same row where it still exists."""
    selected = None
    if table.row_count and table.cursor_row >= 0:
        selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    table.clear()
    for i, row in enumerate(rows):
        table.add_row(*row, key=keys[i] if keys else None)
    if selected is not None and keys and selected in keys:
        table.move_cursor(row=keys.index(selected))
