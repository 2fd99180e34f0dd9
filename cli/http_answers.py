"""Reading a server's answer in the commands that call a running `pdcluster serve` (drain, update-weights)."""

from __future__ import annotations


def json_body(response) -> dict | None:
    """The answer's JSON object, or None for anything else (an HTML error page, a list, no body)."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def error_message(body: dict | None) -> str | None:
    """The reason an answer gives: OpenAI's ``{"error": {"message"}}`` or SGLang's ``{"message"}``; None without."""
    if body is None:
        return None
    error = body.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(body["message"]) if body.get("message") else None
