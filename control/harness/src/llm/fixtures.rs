//! Conversation items for the model layer's tests.

use super::model::{Item, Role, ToolOutput};

pub fn user(t: &str) -> Item {
    Item::Message {
        role: Role::User,
        text: t.into(),
        provider_id: None,
    }
}

/// A Bash call with empty arguments.
pub fn call(id: &str) -> Item {
    Item::ToolCall {
        call_id: id.into(),
        name: "Bash".into(),
        arguments: "{}".into(),
        provider_id: None,
    }
}

pub fn result(id: &str, t: &str) -> Item {
    Item::ToolResult {
        call_id: id.into(),
        output: vec![ToolOutput::Text { text: t.into() }],
    }
}
