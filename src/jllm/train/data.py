"""Training data by self-distillation: prompts the target writes itself or that are made from installed
packages' files, and the target's own replies, kept as token ids of jllm's tokenizer.

Prompt sources (none from jllm/spec/corpus.json or any public benchmark or evaluation set):
- magpie: the chat template rendered up to the start of a user message; the target samples the user text
  (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").
- package: a snippet of a .py, .md or .rst file shipped inside an installed Python package (site-packages,
  jllm itself excluded), wrapped in an instruction: explain, write tests for, refactor, find bugs in,
  translate to another language, summarize.
- writing: the target writes a text of a kind about a topic (both from the short lists below, written for
  jllm: stories, articles, meeting notes, letters, ...).
- derived: a text the target wrote (a writing reply), given back to it with a prose task: summarize, list the
  key points, rewrite (plainly, as an email, in the active voice, in the third person), fix the typos that
  this module puts in, translate into a human language; and a translation it made, back into English.
Replies are the target's own, greedy or sampled, up to an end-of-turn token or `max_new` tokens.

On disk (one .npz, FORMAT_VERSION 1): tokens int32 [N] (all conversations concatenated), offsets int64
[n + 1], reply_start int32 [n] (index within its conversation where the reply begins), source int8 [n]
(an index into SOURCES), sampled int8 [n], and meta: a JSON string with the format version, the target's file
name and its tokenizer's fingerprint (a file made for another tokenizer is refused).
"""

from __future__ import annotations

import json
import os
import random
import site
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jllm.errors import JllmError

FORMAT_VERSION = 1
SOURCES = ("magpie", "package", "writing", "derived", "follow-up", "question", "request")
_SENTINEL = "\x00USER\x00"
CHUNK = 4            # prompts per generate call, in batches: the deadline is looked at between calls

CODE_TASKS = (
    "Explain what the following code does, step by step:\n\n```{lang}\n{text}\n```",
    "Write unit tests for this code:\n\n```{lang}\n{text}\n```",
    "Refactor this code to be easier to read, keeping its behaviour:\n\n```{lang}\n{text}\n```",
    "Are there bugs or unhandled edge cases in this code? Explain and fix them.\n\n```{lang}\n{text}\n```",
    "Translate this code to {other}:\n\n```{lang}\n{text}\n```",
    "Add type hints and docstrings to this code:\n\n```{lang}\n{text}\n```",
)
DOC_TASKS = (
    "Summarize this documentation in a few sentences:\n\n{text}",
    "Explain this to a beginner, with a short example:\n\n{text}",
    "Write a code example that uses what this documentation describes:\n\n{text}",
    # prose tasks: a chat target is asked to translate and rewrite text, not only code
    "Translate this text into {human}:\n\n{text}",
    "Rewrite this text in plain, simple words for a newcomer:\n\n{text}",
    "Rewrite this text as a short, friendly email to a colleague:\n\n{text}",
    "Turn this text into a list of its key points:\n\n{text}",
)
OTHER_LANGUAGES = ("JavaScript", "TypeScript", "Rust", "Go", "C++", "Java", "C#", "Kotlin")
HUMAN_LANGUAGES = ("French", "German", "Spanish", "Chinese", "Italian", "Portuguese", "Japanese", "Russian")

WRITING_KINDS = ("a short story", "a news article", "the minutes of a team meeting", "a product description",
                 "a letter to a friend", "a blog post", "a recipe with its steps", "a short essay",
                 "a discussion thread between engineers about a bug", "a brief historical overview",
                 "release notes for a software update", "a travel diary entry", "a speech", "a book review",
                 "a set of instructions for a household task", "a dialogue between two characters")
WRITING_TOPICS = ("a lighthouse keeper", "a city after heavy rain", "learning to play the violin", "a lost cat",
                  "a small bakery", "the first day at a new job", "a mountain village in winter", "a chess club",
                  "a broken elevator", "a garden in spring", "an old railway station", "a science fair",
                  "a storm at sea", "a library that never closes", "moving to another country",
                  "a power outage", "a bicycle repair shop", "a family dinner", "a marathon", "a volcano",
                  "a school play", "an ancient trade route", "a space probe", "a flooded basement",
                  "a farmers' market", "a database migration", "a mobile app launch", "a museum robbery",
                  "a desert expedition", "a beekeeper", "a night train", "a friendship that ended",
                  "a new vaccine", "the invention of printing", "a river that changed its course",
                  "a late delivery", "a hiking accident", "a neighbourhood festival", "a forgotten password",
                  "a jazz concert", "renewable energy in a small town", "a kitchen fire", "an island ferry")
# questions about how things work, beyond code: a coder model's Magpie turns are mostly about programming
QUESTION_FORMS = ("Explain {t}.", "How does {t} work? Explain it simply.", "Can you explain {t} to a high-school "
                  "student?", "What is {t}, and why does it matter?", "Give me an overview of {t}, with an example.",
                  "What are the most common misconceptions about {t}?")
QUESTION_TOPICS = ("photosynthesis", "compound interest", "the way GPS finds a position", "garbage collection",
                   "the legislative process in a parliament", "plate tectonics", "the water cycle",
                   "how a compiler turns source code into machine code", "inflation", "DNS resolution",
                   "an electric motor", "the colours of autumn leaves", "supply and demand",
                   "the causes of the First World War", "a database index", "noise-cancelling headphones",
                   "the greenhouse effect", "how a bicycle stays upright", "the tides", "the Roman Republic",
                   "a REST API", "how a neural network learns", "entropy", "sourdough fermentation",
                   "a CPU cache", "branches in version control", "credit scores", "the placebo effect",
                   "black holes", "a heat pump", "the printing press's effect on Europe", "the stock market",
                   "a solar panel", "lazy evaluation", "the theory of evolution", "a blockchain",
                   "how airplanes fly", "memory leaks", "the Industrial Revolution", "interest rates",
                   "containers and virtual machines", "the human heart", "floating-point numbers",
                   "carbon dating", "a load balancer", "the Silk Road", "unit testing", "earthquakes")
# requests the target writes itself before answering them (source 6): chat users ask long questions of
# several parts with an audience or a length in mind, which the fixed QUESTION_FORMS do not
REQUEST_ASKS = (
    "Write one question that a user might ask an AI assistant about {t}. Make it specific: name two to four "
    "points the answer must cover, and say who the answer is for. Write only the question.",
    "Write a detailed request to an AI assistant for an explanation of {t}. It should ask for several "
    "particular things (a comparison, an example, a cost or a risk) and set how long or how simple the "
    "answer should be. Write only the request.",
    "Imagine a {who} who wants to understand {t}. Write the message they would send to an AI assistant, "
    "asking about two or three concrete aspects in one or two sentences. Write only the message.",
)
PREAMBLES = ("certainly", "sure", "here is", "here's", "of course")   # a reply about the request, not one
REQUEST_WHO = ("student", "junior developer", "product manager", "retired engineer", "journalist",
               "nurse", "small-business owner", "teacher", "data analyst", "curious teenager")
PROSE_TASKS = (
    "Summarize this text in a few sentences:\n\n{text}",
    "Summarize the following in one paragraph:\n\n{text}",
    "List the key points of this text:\n\n{text}",
    "Rewrite this text in plain, simple words:\n\n{text}",
    "Rewrite this text as a short, polite email:\n\n{text}",
    "Rewrite this text in the active voice:\n\n{text}",
    "Rewrite this text in the third person:\n\n{text}",
    "Fix the spelling and grammar mistakes in this text:\n\n{typos}",
    "Translate this text into {human}:\n\n{text}",
    "Translate this text into {human}:\n\n{text}",
    "Translate the following into {human}, keeping its formatting:\n\n{text}",
    "Explain the main idea of this text to a child:\n\n{text}",
    # tasks of two parts, as chat users write them
    "Summarize this text in {k} bullet points, then say in one sentence what matters most in it:\n\n{text}",
    "Summarize this text for {who}, then suggest a title for it:\n\n{text}",
    "Summarize this text in one paragraph, then name the three most important facts in it:\n\n{text}",
    "Rewrite this text for {who}, keeping every fact, then explain what you changed:\n\n{text}",
)
BACK_TASK = "Translate this text into English:\n\n{text}"
TRANSLATION_CUES = ("Translate this text into ", "Translate the following into ")   # PROSE_TASKS' translations
# a second user turn after the target's first reply: chat is several turns, and the second one reads its own
# earlier answer
FOLLOW_UPS = (
    "Can you make that shorter?",
    "Explain the last part in more detail.",
    "Give me another example.",
    "Summarize your answer in three bullet points.",
    "Write that again in {human}.",
    "What could go wrong with this, and how would I notice?",
    "Is there a simpler way to do this?",
    "Why is that better than the obvious alternative?",
    "Turn your answer into a step-by-step checklist.",
    "Rewrite your answer in a more formal tone.",
    "What are the main trade-offs here?",
)
CODE_FOLLOW_UPS = (       # only after a reply about code (the package source)
    "Explain it again for someone who has never programmed.",
    "Thanks. Can you add comments to the code?",
    "Now write a short test for it.",
)


@dataclass
class Conversations:
    """Prompt + reply token ids of each conversation; the loss covers the reply only."""
    tokens: np.ndarray          # int32 [N]
    offsets: np.ndarray         # int64 [n + 1]
    reply_start: np.ndarray     # int32 [n]
    source: np.ndarray          # int8 [n]
    sampled: np.ndarray         # int8 [n]
    meta: dict

    def __len__(self) -> int:
        return len(self.reply_start)

    def ids(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def reply_tokens(self) -> int:
        return int((self.offsets[1:] - self.offsets[:-1] - self.reply_start).sum())

    def save(self, path) -> None:
        np.savez_compressed(path, tokens=self.tokens, offsets=self.offsets, reply_start=self.reply_start,
                            source=self.source, sampled=self.sampled, meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path, fingerprint: str | None = None) -> "Conversations":
        try:
            z = np.load(path)                   # refuses pickled objects: a file from elsewhere runs nothing
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:      # empty, truncated, not an array file
            raise JllmError(f"{path}: not jllm training data ({(str(e) or type(e).__name__).splitlines()[0]})") \
                from None
        if not isinstance(z, np.lib.npyio.NpzFile) or "meta" not in z.files:
            raise JllmError(f"{path}: not jllm training data (no meta in it)")
        with z:
            meta = json.loads(str(z["meta"]))
            if meta.get("version") != FORMAT_VERSION:
                raise JllmError(f"{path}: training data of format {meta.get('version')}, this jllm reads "
                                f"{FORMAT_VERSION}; make it again")
            if fingerprint is not None and meta.get("tokenizer") != fingerprint:
                raise JllmError(f"{path}: made with another tokenizer (that of {meta.get('target')}); "
                                f"make the data again for this target")
            return cls(z["tokens"], z["offsets"], z["reply_start"], z["source"], z["sampled"], meta)

    @classmethod
    def concat(cls, parts: list["Conversations"]) -> "Conversations":
        """The conversations of several files, in order, as one (the first file's meta, plus each's name)."""
        if len(parts) == 1:
            return parts[0]
        sizes = np.array([len(p.tokens) for p in parts])
        bases = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + b for p, b in zip(parts, bases)])
        return cls(np.concatenate([p.tokens for p in parts]), offsets.astype(np.int64),
                   np.concatenate([p.reply_start for p in parts]), np.concatenate([p.source for p in parts]),
                   np.concatenate([p.sampled for p in parts]),
                   dict(parts[0].meta, parts=[p.meta.get("seed") for p in parts]))

    @classmethod
    def build(cls, rows: list[tuple[list[int], list[int], int, bool]], meta: dict) -> "Conversations":
        """rows: (prompt ids, reply ids, source index, sampled)."""
        lengths = [len(p) + len(r) for p, r, _, _ in rows]
        tokens = np.fromiter((t for p, r, _, _ in rows for t in (*p, *r)), dtype=np.int32, count=sum(lengths))
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   np.array([len(p) for p, _, _, _ in rows], dtype=np.int32),
                   np.array([s for _, _, s, _ in rows], dtype=np.int8),
                   np.array([s for _, _, _, s in rows], dtype=np.int8), dict(meta, version=FORMAT_VERSION))


# ---------------------------------------------------------------------------------------------- prompts


def _around_user(template, add_generation_prompt: bool) -> tuple[str, str, str]:
    """The template's rendering of one user message, split around where its text goes: (before, the text's
    marker or "" where the template does not write the text as given, after)."""
    return template.render([{"role": "user", "content": _SENTINEL}],
                           add_generation_prompt=add_generation_prompt).partition(_SENTINEL)


def user_prefix(template, tokenizer) -> list[int]:
    """The ids of the chat template rendered up to where a user message's text begins (Magpie)."""
    before, marker, _ = _around_user(template, False)
    if not marker:
        raise JllmError(f"{template.origin} does not write the user's text as given; cannot make Magpie prompts")
    return tokenizer.encode(before)


def chat_prompt(template, tokenizer, user_text: str) -> list[int]:
    """The ids jllm's chat gives the target for one user turn (the reply follows them)."""
    return tokenizer.encode(template.render([{"role": "user", "content": user_text}], add_generation_prompt=True))


def package_files(roots: list[str] | None = None, limit: int = 50000) -> list[Path]:
    """.py, .md and .rst files under site-packages (jllm's own excluded), at most `limit`, sorted."""
    if roots is None:
        roots = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                        *site.getsitepackages()})
    found: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "jllm" and not d.startswith(("jllm-", ".")))
            for f in sorted(filenames):
                if f.endswith((".py", ".md", ".rst")):
                    found.append(Path(dirpath, f))
                    if len(found) >= limit:
                        return found
    return found


def package_prompts(n: int, rng: random.Random, files: list[Path] | None = None,
                    min_lines: int = 12, max_lines: int = 60, max_chars: int = 3000) -> list[str]:
    """n instructions over snippets of installed packages' files."""
    files = package_files() if files is None else files
    if not files:
        raise JllmError("no .py/.md/.rst files found in site-packages to make prompts from")
    prompts: list[str] = []
    tries = 0
    while len(prompts) < n and tries < 20 * n + 100:
        tries += 1
        path = rng.choice(files)
        try:
            if path.stat().st_size > 400_000:
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) < min_lines:
            continue
        size = rng.randint(min_lines, max_lines)
        start = rng.randint(0, max(0, len(lines) - size))
        text = "\n".join(lines[start:start + size]).strip()[:max_chars]
        if len(text) < 200:
            continue
        if path.suffix == ".py":
            task = rng.choice(CODE_TASKS).format(lang="python", text=text, other=rng.choice(OTHER_LANGUAGES))
        else:
            task = rng.choice(DOC_TASKS).format(text=text, human=rng.choice(HUMAN_LANGUAGES))
        prompts.append(task)
    return prompts


def writing_prompts(n: int, rng: random.Random) -> list[str]:
    """n requests for a text of a kind (WRITING_KINDS) about a topic (WRITING_TOPICS)."""
    return [f"Write {rng.choice(WRITING_KINDS)} about {rng.choice(WRITING_TOPICS)}." for _ in range(n)]


def question_prompts(n: int, rng: random.Random) -> list[str]:
    """n questions on how something works (QUESTION_FORMS x QUESTION_TOPICS)."""
    return [rng.choice(QUESTION_FORMS).format(t=rng.choice(QUESTION_TOPICS)) for _ in range(n)]


def request_asks(n: int, rng: random.Random) -> list[str]:
    """n instructions to the target to write a user's request about a topic (REQUEST_ASKS x QUESTION_TOPICS,
    WRITING_TOPICS)."""
    topics = QUESTION_TOPICS + WRITING_TOPICS
    return [rng.choice(REQUEST_ASKS).format(t=rng.choice(topics), who=rng.choice(REQUEST_WHO)) for _ in range(n)]


def add_typos(text: str, rng: random.Random, rate: float = 0.04) -> str:
    """The text with about `rate` of its words misspelt: two letters swapped, one dropped or doubled."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 1)
            words[i] = rng.choice((w[:j] + w[j + 1] + w[j] + w[j + 2:], w[:j] + w[j + 1:], w[:j] + w[j] + w[j:]))
    return " ".join(words)


def follow_up_prompts(template, tokenizer, rows, rng: random.Random, share: float,
                      sources=(0, 1, 2, 5, 6)) -> list[list[int]]:
    """For about `share` of the finished replies of `sources`, the ids of the conversation continued by a
    second user turn (FOLLOW_UPS), ready for the target's second reply."""
    head, _, tail = _around_user(template, True)
    out = []
    for p, r, s, _ in rows:
        if s not in sources or not r or r[-1] not in tokenizer.eot_ids or rng.random() >= share:
            continue
        reply = finished_text(r, tokenizer)
        if reply is None:
            continue                                    # decoded and encoded again, it would become markup
        text = tokenizer.decode(p, skip_special=False)
        if not (text.startswith(head) and text.endswith(tail)):
            continue                                    # not a one-turn prompt of this template
        user = text[len(head):len(text) - len(tail)]
        follow = rng.choice(FOLLOW_UPS + (CODE_FOLLOW_UPS if s == 1 else ())).format(
            human=rng.choice(HUMAN_LANGUAGES))
        out.append(tokenizer.encode(template.render(
            [{"role": "user", "content": user}, {"role": "assistant", "content": reply},
             {"role": "user", "content": follow}], add_generation_prompt=True)))
    return out


def derived_prompts(texts: list[str], rng: random.Random, back: bool = False) -> list[str]:
    """A prose task over each text the target wrote (PROSE_TASKS), or with `back`, its translation back
    into English."""
    if back:
        return [BACK_TASK.format(text=t) for t in texts]
    return [rng.choice(PROSE_TASKS).format(text=t, typos=add_typos(t, rng), human=rng.choice(HUMAN_LANGUAGES),
                                           k=rng.choice((3, 4, 5)), who=f"a {rng.choice(REQUEST_WHO)}")
            for t in texts]


# ---------------------------------------------------------------------------------------------- generation


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def finished_text(ids: list[int], tok) -> str | None:
    """The text of a generated turn that ended with an end-of-turn token and holds no other special token (it
    would come back as markup once decoded and encoded again), stripped; None for any other."""
    if not ids or ids[-1] not in tok.eot_ids or any(tok.is_special(t) for t in ids[:-1]):
        return None
    return tok.decode(ids[:-1], skip_special=False).strip()


def requests(target, n: int, batch: int, max_new: int, rng: random.Random, seed: int) -> list[str]:
    """n user requests written by the target itself (request_asks), sampled; unfinished, short and marked-up
    ones dropped, and those that talk about the request ("Certainly! Here is ...") rather than being it;
    quotes around a request taken off."""
    tok, tpl = target.tokenizer, target.template
    asks = [chat_prompt(tpl, tok, a) for a in request_asks(n, rng)]
    users: list[str] = []
    for i, part in enumerate(_batches(asks, max(batch, 1))):
        for ids in target.generate(part, max_new, sample=True, temperature=0.9, top_p=0.95, seed=seed + 7919 + i,
                                   rows=batch):
            text = finished_text(ids, tok)
            text = text.strip('"').strip() if text is not None else ""
            if len(text) >= 20 and not text.lower().startswith(PREAMBLES) and "---" not in text:
                users.append(text)
    return users


def magpie_users(target, n: int, batch: int, max_new: int, seed: int) -> list[str]:
    """n user turns sampled by the target from its template's user prefix (empty and marked-up ones dropped)."""
    tok = target.tokenizer
    prefix = user_prefix(target.template, tok)
    users: list[str] = []
    round_ = 0
    while len(users) < n and round_ < 4 * (n // max(batch, 1) + 1):
        outs = target.generate([prefix] * min(batch, 2 * (n - len(users))), max_new, sample=True,
                               temperature=1.0, top_p=0.99, seed=seed + round_)
        round_ += 1
        for ids in outs:
            text = finished_text(ids, tok)                 # None: ran out of tokens, or marked up
            if text is not None and len(text) >= 8:
                users.append(text)
    return users[:n]


def _replies(target, prompts: list[tuple[list[int], int, bool]], batch: int, max_new: int, rng: random.Random,
             seed: int, deadline: float | None, log, t_start: float, rows: list) -> bool:
    """Appends (prompt, reply, source, sampled) to rows for prompts (ids, source, sampled), batched by length
    in a random batch order; False if the deadline stopped it first."""
    prompts = sorted(prompts, key=lambda x: (x[2], len(x[0])))             # like lengths together: less padding
    chunks = list(_batches(prompts, CHUNK * batch))          # `batch` rows decode a chunk, refilled as replies end
    rng.shuffle(chunks)
    for chunk in chunks:
        if deadline is not None and time.perf_counter() > deadline:
            return False
        for mode in (False, True):
            part = [x for x in chunk if x[2] == mode]
            if not part:
                continue
            replies = target.generate([p for p, _, _ in part], max_new, sample=mode, temperature=0.8,
                                      top_p=0.95, seed=seed + len(rows), rows=batch)
            rows += [(p, r, s, m) for (p, s, m), r in zip(part, replies) if r]
        log(f"data: {len(rows)} replies, {sum(len(r) for _, r, _, _ in rows)} tokens, "
            f"{time.perf_counter() - t_start:.0f} s")
    return True


def _finished_texts(rows, tok, source: int, first: int = 0, min_tokens: int = 60, want=None) -> list[str]:
    """The texts of the replies of `source` (rows[first:]) that ended their turn and are long enough."""
    out = []
    for p, r, s, _ in rows[first:]:
        if s == source and len(r) >= min_tokens and (want is None or want(p)):
            text = finished_text(r, tok)
            if text is not None:
                out.append(text)
    return out


def generate(target, n_magpie: int, n_package: int, max_new: int = 512, batch: int = 32,
             user_max_new: int = 128, sampled_frac: float = 0.5, max_prompt: int = 1024, seed: int = 0,
             files: list[Path] | None = None, log=print, time_limit: float | None = None,
             n_writing: int = 0, follow_share: float = 0.0, n_questions: int = 0,
             n_requests: int = 0) -> Conversations:
    """Self-distilled conversations: the prompts of every source, the target's replies to them. In three
    rounds: magpie, package, writing, question and request prompts (magpie turns and requests written by the
    target first); then the derived tasks over the finished writing, question and request replies and, for
    `follow_share` of the first round's finished replies, a second user turn (FOLLOW_UPS); then the derived
    translations back into English. A time_limit (seconds for the replies) gives the rounds 60, 28 and 12 %
    of it (80 and 20 % with follow-ups alone, all of it to the first round with neither); within a round
    batches of like lengths run in a random order, so a cut keeps a sample of every source, length and mode."""
    rng = random.Random(seed)
    tok, tpl = target.tokenizer, target.template
    t0 = time.perf_counter()
    users = [(u, 0) for u in magpie_users(target, n_magpie, batch, user_max_new, seed)] if n_magpie else []
    users += [(u, 6) for u in requests(target, n_requests, batch, user_max_new, rng, seed)] if n_requests else []
    t1 = time.perf_counter()
    users += [(u, 1) for u in package_prompts(n_package, rng, files)] if n_package else []
    users += [(u, 2) for u in writing_prompts(n_writing, rng)]
    users += [(u, 5) for u in question_prompts(n_questions, rng)]

    def prompts_of(texts_sources):
        ids = [(chat_prompt(tpl, tok, u), s) for u, s in texts_sources]
        return [(p, s, rng.random() < sampled_frac) for p, s in ids if len(p) <= max_prompt]

    derives = bool(n_writing or n_questions or n_requests)     # derived tasks, then their translations back
    two_rounds = derives or follow_share > 0
    # the time limit's share of each round by the rounds that run; follow-ups alone make a second round of
    # about a third of the first's size
    share = (0.6, 0.88, 1.0) if derives else (0.8, 1.0, 1.0) if two_rounds else (1.0, 1.0, 1.0)
    deadline = (lambda f: None) if time_limit is None else (lambda f: t1 + f * time_limit)
    rows: list = []
    done = _replies(target, prompts_of(users), batch, max_new, rng, seed, deadline(share[0]), log, t1, rows)
    if two_rounds:
        first = len(rows)
        texts = _finished_texts(rows, tok, 2) + _finished_texts(rows, tok, 5) + _finished_texts(rows, tok, 6)
        second = prompts_of([(u, 3) for u in derived_prompts(texts, rng)])
        second += [(p, 4, rng.random() < sampled_frac) for p in follow_up_prompts(tpl, tok, rows, rng, follow_share)
                   if len(p) <= max_prompt]
        done &= _replies(target, second, batch, max_new, rng, seed, deadline(share[1]), log, t1, rows)
        is_translation = lambda p: any(c in tok.decode(p, skip_special=False) for c in TRANSLATION_CUES)  # noqa: E731
        texts = _finished_texts(rows, tok, 3, first, want=is_translation)
        done &= _replies(target, prompts_of([(u, 3) for u in derived_prompts(texts, rng, back=True)]), batch,
                         max_new, rng, seed, deadline(share[2]), log, t1, rows)
    if not done:
        log(f"data: the time limit of {time_limit:.0f} s cut some rounds short, after {len(rows)} replies")
    t2 = time.perf_counter()
    conv = Conversations.build(rows, dict(target=Path(target.path).name, tokenizer=tok.fingerprint(),
                                          max_new=max_new, seed=seed))
    counts = ", ".join(f"{int((conv.source == i).sum())} {name}" for i, name in enumerate(SOURCES))
    log(f"data: {len(conv)} conversations ({counts}), {conv.reply_tokens()} reply tokens, "
        f"{len(conv.tokens)} in all; user turns {t1 - t0:.1f} s, replies {t2 - t1:.1f} s")
    return conv


def draft_vocab(conv: Conversations, vocab_size: int, n: int, always=()) -> np.ndarray:
    """d2t: the ids of the draft vocabulary, ascending: `always` (the end-of-turn ids), then the target's most
    frequent reply tokens, then its most frequent prompt tokens, then the lowest unused ids; min(n, vocab)."""
    n = min(n, vocab_size)
    reply = np.zeros(vocab_size, dtype=np.int64)
    every = np.bincount(conv.tokens, minlength=vocab_size)[:vocab_size]
    for i in range(len(conv)):
        ids = conv.ids(i)[conv.reply_start[i]:]
        reply += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    key = np.lexsort((np.arange(vocab_size), -every, -reply))   # reply count, then overall count, then id
    chosen = list(dict.fromkeys([int(t) for t in always if t < vocab_size] + key.tolist()))[:n]
    return np.array(sorted(chosen), dtype=np.int64)
