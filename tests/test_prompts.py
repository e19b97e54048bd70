"""The typed prompt (`gemma4.serve.prompts`): every kind of prompt classified once, bad values
refused with a message for the user, the one empty check, the one length rule, the one default
mode, the completion markers. No engine: these run in milliseconds."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from gemma4.serve import conversation, prompts
from gemma4.serve.prompts import (
    ChatPrompt,
    CompletionPrompt,
    TokenPrompt,
    check_markers,
    check_not_empty,
    classify,
    default_mode,
)
from gemma4.serve.requests import EMPTY_PROMPT, Embeddings, RequestError, check_prompt_length

IMAGE = {"type": "image", "media": "pic"}  # classification never opens the file
AUDIO = {"type": "audio", "media": "clip"}
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def test_messages_are_a_chat_with_their_settings():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = classify(msgs, system="S", tools=TOOLS, thinking=True)
    assert got == ChatPrompt(tuple(msgs), "S", tuple(TOOLS), True)
    assert classify(tuple(msgs)).messages == tuple(msgs)  # a tuple of messages too
    assert classify(msgs, mode="chat") == classify(msgs, mode="auto") == classify(msgs)


def test_display_messages_are_dropped_once():
    thought = {"role": "assistant", "content": "hmm", "metadata": {"title": "Thought"}}
    msgs = [{"role": "user", "content": "Hi"}, thought, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "And?"}]
    assert classify(msgs).messages == (msgs[0], msgs[2], msgs[3])
    with pytest.raises(RequestError, match=EMPTY_PROMPT):
        classify([thought])  # nothing left to answer


def test_a_text_follows_the_one_mode_rule():
    # No mode (or "auto"): the model's own, a chat turn for an instruction-tuned model, the text
    # continued for a base model.
    assert classify("Hi") == ChatPrompt(({"role": "user", "content": "Hi"},))
    assert classify("Hi", mode="auto", base_model=True) == CompletionPrompt("Hi")
    assert classify("Hi", base_model=True) == CompletionPrompt("Hi")
    assert classify("Hi", mode="chat", base_model=True) == ChatPrompt(({"role": "user", "content": "Hi"},))
    assert classify("Hi", mode="completion") == CompletionPrompt("Hi")
    assert (default_mode(False), default_mode(True)) == ("chat", "completion")


def test_every_entry_point_defaults_to_the_one_rule():
    """The library's functions all default to mode=None (the rule); none picks its own."""
    for fn in (conversation.stream_reply, conversation.submit, conversation.prompt_ids, conversation.classify_request,
               prompts.classify):
        assert inspect.signature(fn).parameters["mode"].default is None, fn.__name__
    for fn in (conversation.generate, conversation.complete_reply):  # stream_reply's own arguments
        assert "mode" not in inspect.signature(fn).parameters, fn.__name__


def test_a_text_with_media():
    chat = classify("Look <|image|> now", media=[IMAGE], system="S")
    assert chat == ChatPrompt(({"role": "user", "content": [{"type": "text", "text": "Look "}, IMAGE,
                                                            {"type": "text", "text": " now"}]},), "S")
    assert chat.media_parts() == [(0, IMAGE)]
    assert classify("<|image|> and <|audio|>", mode="completion", media=[IMAGE, AUDIO]) == \
        CompletionPrompt("<|image|> and <|audio|>", (IMAGE, AUDIO))
    assert classify("<|image|>", mode="completion", media=[IMAGE]).media == (IMAGE,)  # a marker is not blank
    assert classify("a <|image|>", mode="completion") == CompletionPrompt("a <|image|>")  # no files: plain text


def test_media_parts_of_a_chat_in_order():
    msgs = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "a"}]},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": [{"type": "text", "text": "c"}, AUDIO, IMAGE]},
            {"role": "user", "content": IMAGE}]
    assert classify(msgs).media_parts() == [(0, IMAGE), (2, AUDIO), (2, IMAGE), (3, IMAGE)]


def test_ids_and_segments_are_used_as_given():
    assert classify([2, 5, 6]) == TokenPrompt((2, 5, 6))
    assert classify(np.array([2, 5, 6]).tolist()) == TokenPrompt((2, 5, 6))
    assert classify([np.int32(2), np.int64(7)]) == TokenPrompt((2, 7))
    rows = Embeddings(np.zeros((3, 4), np.float32))
    seg = classify([[2, 5], rows, (6,)], mode="completion")
    assert seg.segments[0] == (2, 5) and seg.segments[1] is rows and seg.positions == 6
    assert classify([[2], [5, 6]]).positions == 3


@pytest.mark.parametrize("prompt,kw,match", [
    ("Hi", {"mode": "poetry"}, "mode must be 'chat', 'completion' or 'auto'"),
    ({"role": "user"}, {}, "prompt must be text, token ids or chat messages, not dict"),
    (None, {}, "not NoneType"),
    (["a", "b"], {}, "a token-id prompt holds integers"),
    ([1.5, 2], {}, "a token-id prompt holds integers"),
    ([{"role": "user", "content": "x"}, "oops"], {}, "message 1 must be a mapping"),
    ("Hi", {"tools": {"name": "f"}}, "tools must be a list"),
    ("Hi", {"thinking": True, "mode": "completion"}, "need a chat request"),
    ("Hi", {"tools": TOOLS, "base_model": True}, "need a chat request"),
    ([2, 5], {"thinking": True}, "token-id prompt is used as given: thinking"),
    ([2, 5], {"mode": "chat"}, "mode='chat' renders messages or text"),
    ([2, 5], {"media": [IMAGE]}, "media= needs a text prompt"),
    ([{"role": "user", "content": "x"}], {"media": [IMAGE]}, "media= goes with a text prompt"),
    ([{"role": "user", "content": "x"}], {"mode": "completion"}, "Messages are a chat"),
    ("one <|image|>", {"mode": "completion", "media": [IMAGE, IMAGE]}, "1 <|image|> and 0 <|video|> markers but 2 image"),
    ("<|audio|> <|image|>", {"mode": "completion", "media": [IMAGE, AUDIO]}, "Marker 1 is <|audio|> but file 1"),
    ("<|image|>", {"media": ["pic.png"]}, "media= takes parts like"),
])
def test_bad_prompts_are_refused_with_a_reason(prompt, kw, match):
    with pytest.raises(RequestError, match=match.replace("|", r"\|").replace("(", r"\(")):
        classify(prompt, **kw)


@pytest.mark.parametrize("prompt,kw", [
    ("", {}), ("  \n", {}), ("   ", {"mode": "completion"}),
    ([{"role": "user", "content": "  "}], {}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}, {"role": "user", "content": None}], {}),
    ([{"role": "user", "content": [{"type": "text", "text": " "}]}], {}),
    ([], {}), ([2], {}), ((), {}),
])
def test_the_one_empty_check(prompt, kw):
    with pytest.raises(RequestError, match=EMPTY_PROMPT):
        classify(prompt, **kw)


def test_what_is_not_empty():
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}
    for typed in (ChatPrompt(({"role": "user", "content": [IMAGE]},)), ChatPrompt(({"role": "user", "content": "x"}, call)),
                  ChatPrompt(({"role": "tool", "content": "sunny"},)), CompletionPrompt("", (IMAGE,)),
                  TokenPrompt((2, 5))):
        check_not_empty(typed)


def test_the_one_length_rule():
    assert check_prompt_length(10, 512) == 502 and check_prompt_length(511, 512) == 1
    for n in (0, 1):
        with pytest.raises(RequestError, match=EMPTY_PROMPT):
            check_prompt_length(n, 512)
    with pytest.raises(RequestError) as e:
        check_prompt_length(512, 512)
    assert str(e.value) == ("The prompt is 512 tokens but the context window is 512 tokens. Shorten it (or start "
                            "a new conversation).")
    with pytest.raises(RequestError) as e:  # the same rule with media: the message says how much is theirs
        check_prompt_length(900, 512, soft_tokens=750)
    assert str(e.value).startswith("The prompt with its media is 900 tokens (750 of them soft tokens) but the "
                                   "context window is 512 tokens. Send fewer or smaller media")


def test_markers():
    assert prompts.count_markers("<|image|> a <|video|><|image|> <|audio|>") == {"image": 2, "video": 1, "audio": 1}
    check_markers("a <|image|> b <|audio|>", [IMAGE, AUDIO])
    parts = prompts.parts_in_marker_order("<|audio|> x <|image|>", ["pic"], [], 70, audio=["clip"])
    assert parts == [{"type": "audio", "media": "clip"}, {"type": "image", "media": "pic", "max_soft_tokens": 70}]
    with pytest.raises(RequestError, match="but 1 image"):
        prompts.parts_in_marker_order("<|image|><|image|>", ["pic"], [])


def test_cancel_is_a_request_error():
    import threading

    ev = threading.Event()
    prompts.check_cancel(ev)
    prompts.check_cancel(None)
    ev.set()
    with pytest.raises(prompts.RequestCancelled):
        prompts.check_cancel(ev)
    assert issubclass(prompts.RequestCancelled, RequestError)
