"""The `if __name__ == "__main__":` guard, checked before the batched engine starts its worker processes.

The batched engine (coordinator/sim/batched.py) trains on worker processes started with multiprocessing's
*spawn* method. A spawned child first runs the parent's main script again, as module `__mp_main__`, to find what
it pickled. A script that calls `dropfl.simulate(...)` at module level, outside the guard, would then start the
whole run again in each worker (into the same run directory), and the worker dies while bootstrapping: the
parent sees a `BrokenProcessPool`.

Two checks, both before anything is written:

- `check_caller` (in the parent): would a spawned child run this call again? multiprocessing's own
  `spawn.get_preparation_data` says whether, and from which file, a child re-runs the main module (not for
  `python -c`, stdin, a REPL or a package's `__main__`). If it does, the main module's top-level frame is found
  on the stack and its current statement looked up in the module's source: a statement inside an
  `if __name__ == "__main__":` block is not run by the child; any other is.
- `check_not_bootstrapping` (in a child): multiprocessing marks a process that is still importing its parent's
  main module (`current_process()._inheriting`, the flag its own "An attempt has been made to start a new
  process before the current process has finished its bootstrapping phase" check reads). A call from there is a
  re-run; refused with the same line. Reached only where the parent could not read the script's source.

The refusal is `MainGuardError`: a `UserError` (catch it as any bad input) that is also a `SystemExit`, so a
script that does not catch it ends with the one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from multiprocessing import spawn

from coordinator.errors import UserError

HOW = 'put the call under if __name__ == "__main__": (docs/api.md)'


class MainGuardError(UserError, SystemExit):
    """`simulate` called from a script's top level without the `__main__` guard. Uncaught, it ends the script
    with one line on stderr (`dropfl: error: ...`), exit status 1."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = f"dropfl: error: {message}"   # what the interpreter prints for an uncaught SystemExit


def check_not_bootstrapping(what: str) -> None:
    """Refuse a call made while this process, a spawned worker, is still importing its parent's script."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        script = _main_file() or (sys.argv[0] if sys.argv else "")   # spawn.prepare set sys.argv to the parent's
        raise MainGuardError(f"{what}() was called again by a worker process of the batched engine, which runs "
                             f"the script{' ' + script if script else ''} again as it starts: {HOW}")


def check_caller(what: str) -> None:
    """Refuse a call from the main script's top level outside the guard, where spawned workers would rerun it."""
    path = _rerun_file()
    if path is None:
        return
    line = _main_line()
    if line is None:   # not called while the main script's top level runs (a thread, a callback later, a test)
        return
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return   # no source to look at: check_not_bootstrapping refuses the rerun in the worker
    if not guarded(tree, line):
        raise MainGuardError(f"{what}() is called at the top level of {path} (line {line}), where each worker "
                             f"process of the batched engine would run it again (they start by running the "
                             f"script): {HOW}")


def _main_file() -> str | None:
    return getattr(sys.modules.get("__main__"), "__file__", None)


def _rerun_file() -> str | None:
    """The file a spawned child runs again as `__mp_main__`, or None where it runs none (multiprocessing's own
    decision: spawn.get_preparation_data, and the cases spawn.prepare skips)."""
    try:
        data = spawn.get_preparation_data("dropfl")
    except RuntimeError:    # this process is still bootstrapping: check_not_bootstrapping's case
        return _main_file()
    name = data.get("init_main_from_name")
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return None     # spawn.prepare does not import a package's __main__ again
        return _main_file()
    path = data.get("init_main_from_path")
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


def _main_line() -> int | None:
    """The line the main module's top-level code is executing (the outermost frame running it), or None."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    frame, found = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            found = frame.f_lineno
        frame = frame.f_back
    return found


def _is_main_test(test: ast.expr) -> str | None:
    """"==" for `__name__ == "__main__"` (either order), "!=" for `__name__ != "__main__"`, else None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and len(test.comparators) == 1):
        return None
    sides = (test.left, test.comparators[0])
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    if names != {"__name__"} or consts != {"__main__"}:
        return None
    op = test.ops[0]
    return "==" if isinstance(op, ast.Eq) else "!=" if isinstance(op, ast.NotEq) else None


def guarded(tree: ast.Module, line: int) -> bool:
    """Whether `line` of the module lies in a block that runs only in the main process (`if __name__ ==
    "__main__":` or the else of `!=`)."""
    def inside(stmts: list[ast.stmt]) -> bool:
        return any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in stmts)

    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            kind = _is_main_test(node.test)
            if (kind == "==" and inside(node.body)) or (kind == "!=" and inside(node.orelse)):
                return True
    return False
