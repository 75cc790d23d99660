//! The context builder: the model's input, assembled in memory.
//!
//! Pure: no I/O, no clock, no persistence. The coordinator feeds it what
//! happened (also when replaying a session) and asks it to [`build`] the
//! next request. Item 0 is the system message: the preamble (the contract
//! of asynchronous turns, `prompts/preamble.md`), the skills manifest when
//! there are skills, then the system prompt. The conversation is a
//! committed prefix (what was already sent) and a staged suffix (what
//! arrived since); a model response goes to the end of the committed prefix,
//! so it precedes inputs that arrived while it was being produced.
//!
//! Unlike a builder that sends everything, this one enforces a budget and
//! says what it changed: when the whole request is estimated to exceed the
//! model's window the oldest tool outputs are elided first. Each change is
//! listed in the [`Report`] with its source and reason. User messages and
//! the system message are never changed, and a tool result is never cut
//! here: each tool bounds its own output where it is made (a command's
//! streams keep their head and tail, with the exact bytes left out), so the
//! model never reads a result cut twice. The order the wire protocols need
//! is applied when a request is put on the wire ([`crate::llm::conform`]).
//!
//! [`build`]: ContextBuilder::build

use crate::llm::{Item, Request, Response, Role, Tool, ToolChoice, ToolOutput};

/// The async-turn contract, in our words.
pub const PREAMBLE: &str = include_str!("../../../prompts/preamble.md");
/// What precedes the list of skills.
pub const SKILLS_PREAMBLE: &str = include_str!("../../../prompts/skills.md");
/// What a running call shows until its result arrives.
pub const RUNNING_PLACEHOLDER: &str = include_str!("../../../prompts/running.md");
/// How a late result (its placeholder already sent) is introduced;
/// `{call_id}` names the call.
pub const LATE_RESULT: &str = include_str!("../../../prompts/late-result.md");
/// Opens a heartbeat, followed by the list of running calls.
pub const HEARTBEAT: &str = include_str!("../../../prompts/heartbeat.md");
/// Tells the model its sandbox was replaced (`{reason}`: why it was lost).
pub const SANDBOX_REPLACED: &str = include_str!("../../../prompts/sandbox-replaced.md");
/// What the model is told when a suspended session goes on on another
/// worker (its files came along).
pub const SANDBOX_MOVED: &str = include_str!("../../../prompts/sandbox-moved.md");
/// The system prompt of a session that is given none.
pub const DEFAULT_SYSTEM_PROMPT: &str = include_str!("../../../prompts/system.md");

/// A skill the model may load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkillInfo {
    pub name: String,
    pub description: String,
    /// Absolute path of its SKILL.md.
    pub location: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Omitted,
    Truncated,
    Compacted,
}

/// One thing the builder left out or shortened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub kind: ChangeKind,
    /// E.g. `tool result call_12`.
    pub source: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub changes: Vec<Change>,
}

/// A request ready to send, and what was changed to make it fit.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    pub request: Request,
    pub report: Report,
    /// The estimated size of the request, in tokens.
    pub estimated_tokens: u64,
}

/// Limits the builder enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// The model's context window, in tokens.
    pub context_window_tokens: u64,
    /// Kept free for the answer, at most: the session's
    /// `max_output_tokens` when it names one (else 16,000); never more
    /// than a quarter of the window (see [`Budget::reserve`]).
    pub reserve_output_tokens: u64,
    /// Bytes of each output stream a command keeps (head and tail) when the
    /// model does not say; the Bash tool's default `max_output_length`.
    pub max_tool_result_chars: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            context_window_tokens: 200_000,
            reserve_output_tokens: 16_000,
            max_tool_result_chars: 40_000,
        }
    }
}

impl Budget {
    /// Tokens kept free for the answer: what it may take, but at most a
    /// quarter of the window, so a small window (llama.cpp's and Ollama's
    /// 4k, 8k or 16k) keeps three quarters for the request.
    pub fn reserve(&self) -> u64 {
        self.reserve_output_tokens
            .min(self.context_window_tokens / 4)
    }
}

/// Rough token estimate: four characters a token, a fixed cost per item
/// and per image. Errs high rather than low.
const CHARS_PER_TOKEN: u64 = 4;
const ITEM_OVERHEAD_TOKENS: u64 = 8;
const IMAGE_TOKENS: u64 = 1_600;

#[derive(Debug, Clone, PartialEq)]
struct Entry {
    item: Item,
    /// A tool result that is only the running placeholder.
    placeholder: bool,
    /// The final result of a call whose placeholder was already sent: it
    /// goes to the model as a user message, since a second output for one
    /// call is refused by some providers (Chat Completions wants tool
    /// messages right after their call).
    late: bool,
}

/// How a late result is introduced to the model (`prompts/late-result.md`):
/// a user message of the header, then the result's text and images.
pub fn late_result_parts(call_id: &str, output: &[ToolOutput]) -> Vec<ToolOutput> {
    let mut parts = vec![ToolOutput::Text {
        text: LATE_RESULT.trim_end().replace("{call_id}", call_id).into(),
    }];
    parts.extend(output.iter().cloned());
    parts
}

#[derive(Debug, Clone, PartialEq)]
pub struct ContextBuilder {
    preamble: String,
    system_prompt: String,
    model: String,
    reasoning_effort: Option<String>,
    max_output_tokens: Option<u32>,
    tool_choice: Option<ToolChoice>,
    /// A forced tool choice stays after the tool was called (otherwise it
    /// is `auto` from then until the next user message).
    keep_tool_choice: bool,
    tools: Vec<Tool>,
    committed: Vec<Entry>,
    staged: Vec<Entry>,
    /// The calls with a placeholder among the committed entries: looked up
    /// for every result, so a long session's replay stays linear.
    committed_placeholders: std::collections::HashSet<String>,
    budget: Budget,
}

/// `s` safe as XML or HTML text or attribute value.
pub(crate) fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The skills manifest appended to the preamble.
pub fn skills_manifest(skills: &[SkillInfo]) -> String {
    let mut xml = String::from("<available_skills>");
    for s in skills {
        xml.push_str(&format!(
            "<skill><name>{}</name><description>{}</description><location>{}</location></skill>",
            xml_escape(&s.name),
            xml_escape(&s.description),
            xml_escape(&s.location)
        ));
    }
    xml.push_str("</available_skills>");
    format!("{}\n\n{xml}", SKILLS_PREAMBLE.trim_end())
}

fn tokens_of(item: &Item) -> u64 {
    let chars = match item {
        Item::Message { text, .. } => text.len(),
        Item::ToolCall {
            name, arguments, ..
        } => name.len() + arguments.len(),
        Item::ToolResult { output, .. } => {
            let mut n = 0;
            for o in output {
                match o {
                    ToolOutput::Text { text } => n += text.len(),
                    ToolOutput::Image { .. } => n += (IMAGE_TOKENS * CHARS_PER_TOKEN) as usize,
                }
            }
            n
        }
        Item::UserContent { parts } => parts
            .iter()
            .map(|o| match o {
                ToolOutput::Text { text } => text.len(),
                ToolOutput::Image { .. } => (IMAGE_TOKENS * CHARS_PER_TOKEN) as usize,
            })
            .sum(),
        Item::Reasoning { raw, summary } => {
            summary.iter().map(String::len).sum::<usize>()
                + raw
                    .get("encrypted_content")
                    .and_then(|v| v.as_str())
                    .map_or(0, str::len)
        }
    };
    ITEM_OVERHEAD_TOKENS + (chars as u64).div_ceil(CHARS_PER_TOKEN)
}

/// `text` cut to its first and last bytes, about `keep` in all (UTF-8
/// safe), with the exact number of bytes left out between them.
fn head_tail(text: &str, keep: usize) -> Option<String> {
    if text.len() <= keep {
        return None;
    }
    let mut head = keep / 2;
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - (keep - keep / 2);
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    Some(format!(
        "{}\n[... {} bytes omitted to fit the context window ...]\n{}",
        &text[..head],
        tail - head,
        &text[tail..]
    ))
}

impl ContextBuilder {
    /// A builder whose preamble lists `skills` (copied).
    pub fn new(skills: &[SkillInfo], budget: Budget) -> Self {
        let mut preamble = PREAMBLE.trim_end().to_string();
        if !skills.is_empty() {
            preamble.push_str("\n\n");
            preamble.push_str(&skills_manifest(skills));
        }
        Self {
            preamble,
            system_prompt: String::new(),
            model: String::new(),
            reasoning_effort: None,
            max_output_tokens: None,
            tool_choice: None,
            keep_tool_choice: false,
            tools: Vec::new(),
            committed: Vec::new(),
            staged: Vec::new(),
            committed_placeholders: std::collections::HashSet::new(),
            budget,
        }
    }

    /// Replaces the skills listed in the system message.
    pub fn set_skills(&mut self, skills: &[SkillInfo]) {
        let mut preamble = PREAMBLE.trim_end().to_string();
        if !skills.is_empty() {
            preamble.push_str("\n\n");
            preamble.push_str(&skills_manifest(skills));
        }
        self.preamble = preamble;
    }

    /// Replaces the system prompt only; the conversation is untouched.
    pub fn set_system_prompt(&mut self, prompt: &str) {
        self.system_prompt = prompt.to_string();
    }

    pub fn set_model(&mut self, model: &str) {
        self.model = model.to_string();
    }

    /// Applies to requests built from now on.
    pub fn set_reasoning_effort(&mut self, effort: Option<String>) {
        self.reasoning_effort = effort;
    }

    pub fn set_max_output_tokens(&mut self, n: Option<u32>) {
        self.max_output_tokens = n;
    }

    /// Keeps a forced tool choice after the tool was called.
    pub fn set_keep_tool_choice(&mut self, keep: bool) {
        self.keep_tool_choice = keep;
    }

    /// The tool choice the next request sends: a forced one (`required`,
    /// a tool's name) becomes `auto` once the model has made such a call
    /// since the last user message, as the OpenAI Agents SDK resets it
    /// (`reset_tool_choice`): a model held to a tool by a grammar (as
    /// llama.cpp holds it) could otherwise never answer in text, and a run
    /// would go on to its last turn.
    fn tool_choice_now(&self) -> Option<ToolChoice> {
        let forced = match &self.tool_choice {
            Some(ToolChoice::Required) => None,
            Some(ToolChoice::Tool(name)) => Some(name.as_str()),
            other => return other.clone(),
        };
        if self.keep_tool_choice {
            return self.tool_choice.clone();
        }
        let called = self
            .committed
            .iter()
            .chain(&self.staged)
            .rev()
            .map(|e| &e.item)
            .take_while(|i| {
                !matches!(
                    i,
                    Item::Message {
                        role: Role::User,
                        ..
                    }
                )
            })
            .any(|i| match i {
                Item::ToolCall { name, .. } => forced.is_none_or(|f| f == &**name),
                _ => false,
            });
        if called {
            Some(ToolChoice::Auto)
        } else {
            self.tool_choice.clone()
        }
    }

    pub fn set_tool_choice(&mut self, choice: Option<ToolChoice>) {
        self.tool_choice = choice;
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    pub fn set_budget(&mut self, budget: Budget) {
        self.budget = budget;
    }

    pub fn add_tool(&mut self, tool: Tool) {
        self.tools.push(tool);
    }

    /// A user's input (staged).
    pub fn add_user_input(&mut self, text: &str) {
        self.staged.push(Entry {
            item: Item::Message {
                role: Role::User,
                text: text.into(),
                provider_id: None,
            },
            placeholder: false,
            late: false,
        });
    }

    /// A heartbeat, shown as a user message (staged).
    pub fn add_heartbeat(&mut self, text: &str) {
        self.add_user_input(text);
    }

    /// The model's output goes after what was sent and before what arrived
    /// while it was answering.
    pub fn add_model_response(&mut self, response: &Response) {
        for item in &response.output {
            self.committed.push(Entry {
                item: item.clone(),
                placeholder: false,
                late: false,
            });
        }
    }

    /// A tool result (staged). `running` stores the placeholder instead of
    /// `output`. A final result replaces a staged placeholder of the same
    /// call in place; a placeholder already sent stays, and the result is
    /// appended, to be sent as a user message.
    pub fn add_tool_result(&mut self, call_id: &str, output: Vec<ToolOutput>, running: bool) {
        let is_placeholder_of = |e: &Entry| {
            e.placeholder
                && matches!(&e.item, Item::ToolResult { call_id: c, .. } if &**c == call_id)
        };
        let sent_placeholder = self.committed_placeholders.contains(call_id);
        if running && (sent_placeholder || self.staged.iter().any(is_placeholder_of)) {
            // Staged when the call was recorded: one placeholder per call.
            return;
        }
        let output = if running {
            vec![ToolOutput::Text {
                text: RUNNING_PLACEHOLDER.into(),
            }]
        } else {
            output
        };
        let sent_placeholder = !running && sent_placeholder;
        let entry = Entry {
            item: Item::ToolResult {
                call_id: call_id.into(),
                output,
            },
            placeholder: running,
            late: sent_placeholder,
        };
        let staged_placeholder = self.staged.iter().position(|e| {
            e.placeholder
                && matches!(&e.item, Item::ToolResult { call_id: c, .. } if &**c == call_id)
        });
        match staged_placeholder {
            Some(i) => self.staged[i] = entry,
            None => self.staged.push(entry),
        }
    }

    /// Staged becomes committed (idempotent): call when a turn is sent.
    pub fn commit(&mut self) {
        for e in &self.staged {
            if let (true, Item::ToolResult { call_id, .. }) = (e.placeholder, &e.item) {
                self.committed_placeholders.insert(call_id.to_string());
            }
        }
        self.committed.append(&mut self.staged);
    }

    pub fn system_message(&self) -> String {
        format!("{}\n\n{}", self.preamble, self.system_prompt)
            .trim()
            .to_string()
    }

    /// The next request (a snapshot: it shares nothing with the builder),
    /// fitted to the budget, with a report of every change.
    pub fn build(&self) -> Built {
        let mut report = Report::default();
        let mut input = Vec::with_capacity(1 + self.committed.len() + self.staged.len());
        input.push(Item::Message {
            role: Role::System,
            text: self.system_message().into(),
            provider_id: None,
        });
        let mut late = Vec::new();
        for entry in self.committed.iter().chain(&self.staged) {
            if entry.late {
                late.push(input.len());
            }
            input.push(entry.item.clone());
        }
        let tools_tokens: u64 = self
            .tools
            .iter()
            .map(|t| {
                ITEM_OVERHEAD_TOKENS
                    + ((t.name.len() + t.description.len() + t.parameters.to_string().len()) as u64)
                        .div_ceil(CHARS_PER_TOKEN)
            })
            .sum();
        let mut estimate: u64 = tools_tokens + input.iter().map(tokens_of).sum::<u64>();
        let limit = self
            .budget
            .context_window_tokens
            .saturating_sub(self.budget.reserve());
        if estimate > limit {
            // Oldest tool outputs go first; the latest one is kept, since it
            // is what the model is about to act on.
            let results: Vec<usize> = input
                .iter()
                .enumerate()
                .filter(|(_, i)| matches!(i, Item::ToolResult { .. }))
                .map(|(n, _)| n)
                .collect();
            for &n in results.iter().take(results.len().saturating_sub(1)) {
                if estimate <= limit {
                    break;
                }
                let before = tokens_of(&input[n]);
                let Item::ToolResult { call_id, output } = &mut input[n] else {
                    continue;
                };
                let chars = ToolOutput::text_of(output).chars().count();
                let images = ToolOutput::images_in(output);
                let mut what = format!("{chars} characters");
                if images > 0 {
                    what.push_str(&format!(" and {images} image(s)"));
                }
                *output = vec![ToolOutput::Text {
                    text: format!("[output elided to fit the context window: {what}]").into(),
                }];
                let call = call_id.clone();
                let after = tokens_of(&input[n]);
                estimate = estimate - before + after;
                report.changes.push(Change {
                    kind: ChangeKind::Omitted,
                    source: format!("tool result {call}"),
                    reason: format!(
                        "the request was estimated over the window of {} tokens ({} kept for the answer); oldest tool outputs are elided first",
                        self.budget.context_window_tokens, self.budget.reserve()
                    ),
                });
            }
            // The latest output alone is over the window: the last resort
            // is to keep its head and tail, saying exactly what was cut.
            if let Some(&n) = results.last()
                && estimate > limit
                && let Item::ToolResult { call_id, .. } = &input[n]
            {
                let over_chars = (estimate - limit) * CHARS_PER_TOKEN;
                let call = call_id.clone();
                let before = tokens_of(&input[n]);
                if let Item::ToolResult { output, .. } = &mut input[n] {
                    for o in output.iter_mut() {
                        if let ToolOutput::Text { text } = o {
                            let keep = (text.len() as u64).saturating_sub(over_chars).max(1_000);
                            if let Some(cut) = head_tail(text, keep as usize) {
                                *text = cut.into();
                            }
                        }
                    }
                }
                estimate = estimate - before + tokens_of(&input[n]);
                report.changes.push(Change {
                    kind: ChangeKind::Truncated,
                    source: format!("tool result {call}"),
                    reason: format!(
                        "the latest tool output alone is over the window of {} tokens ({} kept for the answer); its head and tail are kept",
                        self.budget.context_window_tokens, self.budget.reserve()
                    ),
                });
            }
        }
        for n in late {
            if let Item::ToolResult { call_id, output } = &input[n] {
                input[n] = Item::UserContent {
                    parts: late_result_parts(call_id, output),
                };
            }
        }
        Built {
            request: Request {
                model: self.model.clone(),
                input,
                tools: self.tools.clone(),
                // Bounded always: unless the session names its own bound,
                // what the budget keeps free for the answer (a model that
                // never stops, as a local one may, ends there).
                max_output_tokens: self
                    .max_output_tokens
                    .or_else(|| u32::try_from(self.budget.reserve()).ok()),
                reasoning_effort: self.reasoning_effort.clone(),
                cache_key: None,
                tool_choice: self.tool_choice_now(),
            },
            report,
            estimated_tokens: estimate,
        }
    }
}

#[cfg(test)]
#[path = "context_tests.rs"]
mod tests;
