//! Skills: folders with a `SKILL.md` whose YAML front matter names and
//! describes them. They are found once, when a session starts; the
//! `SkillUse` tool then returns a skill's instructions at once, with no
//! operation. The skill folders are expected in the sandbox under
//! [`SANDBOX_SKILLS_DIR`], where the paths in the manifest point.

use std::path::Path;

use serde::Deserialize;

use super::{CallStatus, Translator, parse_args, text};
use crate::context::SkillInfo;
use crate::llm::{Tool, ToolOutput};
use crate::ops::OpView;

/// Where skill folders live inside a sandbox.
pub const SANDBOX_SKILLS_DIR: &str = "/workspace/.corral/skills";
/// Largest SKILL.md read.
pub const MAX_SKILL_BYTES: u64 = 256 * 1024;
/// Most skills loaded.
pub const MAX_SKILLS: usize = 200;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skill {
    pub info: SkillInfo,
    /// The instructions after the front matter.
    pub body: String,
}

#[derive(Debug, Deserialize)]
struct FrontMatter {
    name: String,
    description: String,
}

/// Parses a SKILL.md: `---`, YAML with `name` and `description`, `---`,
/// then the instructions.
pub fn parse_skill(location: &str, text: &str) -> Result<Skill, String> {
    let rest = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))
        .ok_or_else(|| format!("{location}: no front matter (the file must start with ---)"))?;
    let end = rest
        .find("\n---\n")
        .or_else(|| rest.find("\n---\r\n"))
        .or_else(|| rest.strip_suffix("\n---").map(str::len))
        .ok_or_else(|| format!("{location}: the front matter has no closing ---"))?;
    let (yaml, after) = rest.split_at(end);
    let body = after
        .trim_start_matches('\n')
        .trim_start_matches("---")
        .trim_start_matches(['\r', '\n']);
    let fm: FrontMatter =
        serde_norway::from_str(yaml).map_err(|e| format!("{location}: front matter: {e}"))?;
    let name = fm.name.trim().to_string();
    let description = fm.description.trim().to_string();
    if name.is_empty() || name.len() > 64 {
        return Err(format!("{location}: name must be 1-64 characters"));
    }
    if description.is_empty() || description.len() > 1024 {
        return Err(format!("{location}: description must be 1-1024 characters"));
    }
    Ok(Skill {
        info: SkillInfo {
            name,
            description,
            location: location.to_string(),
        },
        body: body.to_string(),
    })
}

/// Finds `dir/*/SKILL.md` on this machine. A skill that does not parse is
/// an error naming the file: a broken skill is not silently dropped.
pub fn discover(dir: &Path) -> Result<Vec<Skill>, String> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("skills directory {}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .filter(|e| e.path().join("SKILL.md").is_file())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    if entries.len() > MAX_SKILLS {
        return Err(format!("{}: more than {MAX_SKILLS} skills", dir.display()));
    }
    let mut skills: Vec<Skill> = Vec::new();
    for e in entries {
        let file = e.path().join("SKILL.md");
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if size > MAX_SKILL_BYTES {
            return Err(format!(
                "{}: {size} bytes is over {MAX_SKILL_BYTES}",
                file.display()
            ));
        }
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let location = format!(
            "{SANDBOX_SKILLS_DIR}/{}/SKILL.md",
            e.file_name().to_string_lossy()
        );
        let skill = parse_skill(&location, &text)?;
        if skills.iter().any(|s| s.info.name == skill.info.name) {
            return Err(format!("two skills are named {:?}", skill.info.name));
        }
        skills.push(skill);
    }
    Ok(skills)
}

/// `SkillUse {name}`: the skill's instructions.
pub struct SkillUse {
    skills: Vec<Skill>,
}

impl SkillUse {
    pub fn new(skills: Vec<Skill>) -> Self {
        Self { skills }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    name: String,
}

impl Translator for SkillUse {
    fn tool(&self) -> Tool {
        Tool {
            name: "SkillUse".into(),
            description:
                "Load a skill's instructions by its exact name, as listed in available_skills."
                    .into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": false
            }),
        }
    }

    fn translate(&self, arguments: &str) -> CallStatus {
        let args: Args = match parse_args("SkillUse", arguments) {
            Ok(a) => a,
            Err(e) => return CallStatus::Error(e),
        };
        match self.skills.iter().find(|s| s.info.name == args.name) {
            Some(s) => CallStatus::Done(text(format!(
                "Skill {} ({})\n\n{}",
                s.info.name, s.info.location, s.body
            ))),
            None => {
                let names: Vec<&str> = self.skills.iter().map(|s| s.info.name.as_str()).collect();
                CallStatus::Error(format!(
                    "Error: no skill is named {:?} (available: {})",
                    args.name,
                    names.join(", ")
                ))
            }
        }
    }

    fn render(&self, _ops: &[OpView<'_>]) -> Vec<ToolOutput> {
        text("Error: SkillUse runs no operation")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn front_matter_is_real_yaml() {
        let md = "---\nname: pdf-forms\ndescription: >-\n  Fill PDF forms,\n  even \"quoted\" ones: carefully.\nlicense: MIT\n---\n# Steps\n1. Read the form.\n";
        let s = parse_skill("/w/SKILL.md", md).unwrap();
        assert_eq!(s.info.name, "pdf-forms");
        assert_eq!(
            s.info.description,
            "Fill PDF forms, even \"quoted\" ones: carefully."
        );
        assert_eq!(s.body, "# Steps\n1. Read the form.\n");
    }

    #[test]
    fn broken_skills_are_named_errors() {
        assert!(
            parse_skill("a", "# no front matter")
                .unwrap_err()
                .contains("no front matter")
        );
        assert!(
            parse_skill("a", "---\nname: x\n")
                .unwrap_err()
                .contains("no closing")
        );
        let e = parse_skill("a", "---\nname: x\n---\nbody").unwrap_err();
        assert!(e.contains("description"), "{e}");
        let e = parse_skill("a", "---\nname: [unclosed\ndescription: d\n---\n").unwrap_err();
        assert!(e.starts_with("a: front matter:"), "{e}");
    }

    #[test]
    fn discovers_skill_folders_and_serves_them() {
        let dir = tempfile::tempdir().unwrap();
        for (folder, name) in [("b-skill", "beta"), ("a-skill", "alpha")] {
            std::fs::create_dir(dir.path().join(folder)).unwrap();
            std::fs::write(
                dir.path().join(folder).join("SKILL.md"),
                format!("---\nname: {name}\ndescription: does {name}\n---\nDo {name}.\n"),
            )
            .unwrap();
        }
        std::fs::create_dir(dir.path().join("not-a-skill")).unwrap();
        let skills = discover(dir.path()).unwrap();
        let names: Vec<&str> = skills.iter().map(|s| s.info.name.as_str()).collect();
        assert_eq!(names, vec!["alpha", "beta"]);
        assert_eq!(
            skills[0].info.location,
            "/workspace/.corral/skills/a-skill/SKILL.md"
        );
        let tool = SkillUse::new(skills);
        assert_eq!(
            tool.translate(r#"{"name":"beta"}"#),
            CallStatus::Done(text(
                "Skill beta (/workspace/.corral/skills/b-skill/SKILL.md)\n\nDo beta.\n"
            ))
        );
        assert_eq!(
            tool.translate(r#"{"name":"gamma"}"#),
            CallStatus::Error("Error: no skill is named \"gamma\" (available: alpha, beta)".into())
        );
    }
}
