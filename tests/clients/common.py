"""Shared by the client checks (they run in the clients' own venv, not minillm's): one result
line per feature on stdout, as JSON: {"client", "feature", "ok", "detail"}."""
import json
import os
import sys
import traceback

BASE = os.environ["MINILLM_BASE_URL"]          # http://127.0.0.1:PORT
MODEL = os.environ.get("MINILLM_MODEL", "smollm2-135m")


def report(client: str, feature: str, ok: bool, detail: str = "") -> None:
    print(json.dumps({"client": client, "feature": feature, "ok": bool(ok),
                      "detail": str(detail)[:300]}), flush=True)


def check(client: str, feature: str):
    """Decorator: run the function, report ok (its return value is the detail) or the error."""
    def wrap(fn):
        try:
            detail = fn()
            report(client, feature, True, detail or "")
        except Exception as e:                  # noqa: BLE001 - reported as a failure
            traceback.print_exc(file=sys.stderr)
            report(client, feature, False, f"{type(e).__name__}: {e}")
        return fn
    return wrap
