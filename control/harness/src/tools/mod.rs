//! Tool translators: pure and synchronous. A translator reads a call's
//! arguments and turns them into operation specs, or into an error that goes
//! back to the model as the call's result (the run goes on); the registry
//! checks the specs once, as the worker will. Later the translator turns the
//! finished operations, as the session recorded them ([`OpView`]), into the
//! result the model reads. No I/O here: operations do the work, elsewhere.

pub mod bash;
pub mod files;
pub mod skills;
pub mod view_image;

use std::collections::BTreeMap;
use std::sync::Arc;

use corral_proto::OperationSpec;
use serde::de::DeserializeOwned;

use crate::llm::{Tool, ToolOutput};
use crate::ops::OpView;

/// What became of a tool call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallStatus {
    /// Refused: this text is the call's result.
    Error(String),
    /// Accepted: these operations will produce the result.
    Submit(Vec<OperationSpec>),
    /// Accepted and already answered, with no operation (SkillUse).
    Done(Vec<ToolOutput>),
}

/// What became of a tool call, as a session records it: [`CallStatus`]
/// less the operations (recorded beside it, with their ids).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum CallOutcome {
    /// Refused (unknown tool, malformed arguments...): `text` is its result.
    Error { text: String },
    /// Accepted: the call's operations (listed in the record) produce its result.
    Submit,
    /// Answered at once, with no operation.
    Done { output: Vec<ToolOutput> },
}

pub trait Translator: Send + Sync {
    /// The tool as the model sees it.
    fn tool(&self) -> Tool;
    /// Arguments (raw JSON from the model) to operations.
    fn translate(&self, arguments: &str) -> CallStatus;
    /// The model-facing result of the call's operations (in order), as
    /// the session recorded them.
    fn render(&self, ops: &[OpView<'_>]) -> Vec<ToolOutput>;
}

/// The largest tool-call arguments a session keeps and runs (256 KiB:
/// far more than any command or edit; 64k tokens or so). Larger ones are
/// answered with an error and replaced in the conversation by
/// [`omitted_arguments`], so one call cannot fill every later request.
pub const MAX_TOOL_ARGUMENT_BYTES: usize = 256 * 1024;

/// The longest tool name a session keeps (providers allow 64 characters):
/// a longer one is answered with an error and replaced in the conversation
/// by [`omitted_name`], so that no later request, log record or trace
/// carries it.
pub const MAX_TOOL_NAME_BYTES: usize = 128;

/// The start of the placeholder that stands for an omitted tool name.
const OMITTED_NAME: &str = "corral_tool_name_omitted_";

/// What stands in the conversation for a tool name of `bytes` bytes that
/// was over [`MAX_TOOL_NAME_BYTES`] (itself a valid tool name).
pub fn omitted_name(bytes: usize) -> String {
    format!("{OMITTED_NAME}{bytes}")
}

/// The size of the name `name` stands for, if it is the placeholder of
/// [`omitted_name`].
fn omitted_name_size(name: &str) -> Option<u64> {
    name.strip_prefix(OMITTED_NAME)?.parse().ok()
}

/// The key of the placeholder that stands for omitted arguments.
const OMITTED_KEY: &str = "corral_arguments_omitted_bytes";

/// What stands in the conversation for arguments of `bytes` bytes that
/// were over [`MAX_TOOL_ARGUMENT_BYTES`].
pub fn omitted_arguments(bytes: usize) -> String {
    format!("{{\"{OMITTED_KEY}\":{bytes}}}")
}

/// The size of the arguments `arguments` stands for, if it is the
/// placeholder of [`omitted_arguments`].
fn omitted_size(arguments: &str) -> Option<u64> {
    if arguments.len() > 64 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(arguments).ok()?;
    let obj = v.as_object()?;
    (obj.len() == 1).then_some(())?;
    obj.get(OMITTED_KEY)?.as_u64()
}

/// Parses arguments strictly: a JSON object with known fields only.
pub fn parse_args<T: DeserializeOwned>(tool: &str, arguments: &str) -> Result<T, String> {
    let arguments = if arguments.trim().is_empty() {
        "{}"
    } else {
        arguments
    };
    serde_json::from_str::<serde_json::Value>(arguments)
        .map_err(|e| format!("Error: the arguments of {tool} are not valid JSON ({e})"))
        .and_then(|v| {
            if !v.is_object() {
                return Err(format!(
                    "Error: the arguments of {tool} must be a JSON object"
                ));
            }
            serde_json::from_value(v)
                .map_err(|e| format!("Error: invalid arguments for {tool}: {e}"))
        })
}

pub fn text(t: impl Into<Arc<str>>) -> Vec<ToolOutput> {
    vec![ToolOutput::Text { text: t.into() }]
}

/// The tools offered to a session.
#[derive(Default)]
pub struct Registry {
    tools: BTreeMap<String, Box<dyn Translator>>,
}

impl Registry {
    /// Bash, ReadFile, WriteFile and ViewImage.
    pub fn standard() -> Self {
        let mut r = Self::default();
        r.register(Box::new(bash::Bash::default()));
        r.register(Box::new(files::ReadFile));
        r.register(Box::new(files::WriteFile));
        r.register(Box::new(view_image::ViewImage::default()));
        r
    }

    /// The standard tools, and SkillUse when there are skills.
    pub fn with_skills(skills: Vec<skills::Skill>) -> Self {
        let mut r = Self::standard();
        if !skills.is_empty() {
            r.register(Box::new(skills::SkillUse::new(skills)));
        }
        r
    }

    pub fn register(&mut self, t: Box<dyn Translator>) {
        self.tools.insert(t.tool().name, t);
    }

    /// Keeps only the named tools (an allow-list from the request).
    pub fn retain(&mut self, allowed: &[String]) {
        self.tools
            .retain(|name, _| allowed.iter().any(|a| a == name));
    }

    pub fn tools(&self) -> Vec<Tool> {
        self.tools.values().map(|t| t.tool()).collect()
    }

    /// Translates a call. Specs a worker would refuse (a NUL byte in a
    /// command, an empty command, a path too long...) are refused here, at
    /// once, with the worker's own words.
    pub fn translate(&self, name: &str, arguments: &str) -> CallStatus {
        if let Some(bytes) = omitted_name_size(name) {
            return CallStatus::Error(format!(
                "Error: the name of this tool call was {bytes} bytes, over the limit of \
                 {MAX_TOOL_NAME_BYTES}: no tool has such a name, nothing was run, and it was \
                 left out of the conversation. Call one of the tools offered, by its name."
            ));
        }
        if let Some(bytes) = omitted_size(arguments) {
            return CallStatus::Error(format!(
                "Error: the arguments of this {name} call were {bytes} bytes, over the limit of \
                 {MAX_TOOL_ARGUMENT_BYTES}; nothing was run and they were left out of the \
                 conversation. Send large content in parts (write a file piece by piece, or \
                 generate it with a command)."
            ));
        }
        match self.tools.get(name) {
            Some(t) => match t.translate(arguments) {
                CallStatus::Submit(specs) => match specs.iter().find_map(|s| s.validate().err()) {
                    Some(e) => {
                        CallStatus::Error(format!("Error: invalid arguments for {name}: {e}"))
                    }
                    None => CallStatus::Submit(specs),
                },
                other => other,
            },
            None => CallStatus::Error(format!("Error: tool \"{name}\" is not available")),
        }
    }

    /// The result of a call: its error, or its operations rendered.
    pub fn render(&self, name: &str, outcome: &CallOutcome, ops: &[OpView<'_>]) -> Vec<ToolOutput> {
        match (outcome, self.tools.get(name)) {
            (CallOutcome::Error { text: e }, _) => text(e.as_str()),
            (CallOutcome::Done { output }, _) => output.clone(),
            (CallOutcome::Submit, Some(t)) => t.render(ops),
            (CallOutcome::Submit, None) => text(format!("Error: tool \"{name}\" is not available")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tool schemas are part of what the model sees: any change must show
    /// up here. Set `CORRAL_UPDATE_SNAPSHOTS=1` to rewrite the files.
    #[test]
    fn tool_schemas_match_their_snapshots() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/tools/snapshots");
        let update = std::env::var_os("CORRAL_UPDATE_SNAPSHOTS").is_some();
        let skill =
            skills::parse_skill("/s/SKILL.md", "---\nname: s\ndescription: d\n---\n").unwrap();
        for tool in Registry::with_skills(vec![skill]).tools() {
            let json = serde_json::to_string_pretty(&tool).unwrap() + "\n";
            let path = dir.join(format!("{}.json", tool.name));
            if update {
                std::fs::write(&path, &json).unwrap();
            }
            let want = std::fs::read_to_string(&path)
                .unwrap_or_else(|_| panic!("missing snapshot {}", path.display()));
            assert_eq!(json, want, "schema of {} changed", tool.name);
        }
    }

    #[test]
    fn unknown_tools_and_malformed_arguments_are_errors_for_the_model() {
        let r = Registry::standard();
        assert_eq!(
            r.translate("Nope", "{}"),
            CallStatus::Error("Error: tool \"Nope\" is not available".into())
        );
        let CallStatus::Error(e) = r.translate("Bash", "{\"command\": ") else {
            panic!()
        };
        assert!(
            e.starts_with("Error: the arguments of Bash are not valid JSON"),
            "{e}"
        );
        let CallStatus::Error(e) = r.translate("Bash", "[1]") else {
            panic!()
        };
        assert_eq!(e, "Error: the arguments of Bash must be a JSON object");
        let CallStatus::Error(e) = r.translate("Bash", "{\"cmd\": \"ls\"}") else {
            panic!()
        };
        assert!(e.contains("unknown field `cmd`"), "{e}");
        let CallStatus::Error(e) = r.translate("Bash", r#"{"command": "echo a\u0000b"}"#) else {
            panic!("a NUL byte must not reach the worker")
        };
        assert!(e.contains("NUL"), "{e}");
        let CallStatus::Error(e) = r.translate("Bash", r#"{"command": "   "}"#) else {
            panic!()
        };
        assert!(e.contains("empty command"), "{e}");
        let mut only = Registry::standard();
        only.retain(&["ReadFile".to_string()]);
        assert!(matches!(
            only.translate("Bash", "{\"command\":\"ls\"}"),
            CallStatus::Error(_)
        ));
        assert_eq!(only.tools().len(), 1);
    }
}
