//! Byte fields as base64 strings in JSON (a session log keeps file contents
//! and output heads and tails; a JSON array of numbers would be four times
//! larger).

use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serializer};

pub fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
    let text = String::deserialize(d)?;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map(Bytes::from)
        .map_err(serde::de::Error::custom)
}
