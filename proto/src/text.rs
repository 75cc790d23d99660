//! Text from outside (models, commands, sandboxes) made safe to show on a
//! terminal or in a log line.

/// `s` with its control characters made visible (caret notation, `^[`
/// for ESC; C1 controls as `\u{9b}`): what models, commands and sandboxes
/// say reaches the terminal as text, never as escape sequences that move
/// the cursor, retitle the window, write the clipboard or hide what came
/// before. New lines and tabs stay.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    let is_control = |c: char| {
        (c.is_control() && c != '\n' && c != '\t')
            // Line separators, and the bidirectional controls that make a
            // terminal show text in another order than it is.
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !s.chars().any(is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            c if !is_control(c) => out.push(c),
            '\u{7f}' => out.push_str("^?"),
            c if (c as u32) < 0x20 => {
                out.push('^');
                out.push(char::from(c as u8 + 0x40));
            }
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    std::borrow::Cow::Owned(out)
}
