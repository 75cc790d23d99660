//! ViewImage: show the model an image file from the sandbox.
//!
//! The translator asks for the file's bytes (a bounded read); rendering
//! decodes them by content (JPEG, PNG, WebP, BMP, TIFF), refuses images with
//! too many pixels before decoding them, scales to fit (never up), and
//! returns the image as a `data:` URL with a line saying what was done.

use std::io::Cursor;

use base64::Engine;
use corral_proto::{OperationSpec, ReadFileSpec};
use image::{ImageFormat, ImageReader, Limits};
use serde::Deserialize;

use super::{CallStatus, Translator, parse_args, text};
use crate::llm::{Tool, ToolOutput};
use crate::ops::OpView;

#[derive(Debug, Clone, Copy)]
pub struct ViewImage {
    /// Largest file read (bytes).
    pub max_source_bytes: u64,
    /// Largest image decoded (width × height).
    pub max_source_pixels: u64,
    /// The result fits in this box.
    pub max_width: u32,
    pub max_height: u32,
    /// Largest base64 payload returned.
    pub max_base64_bytes: usize,
}

impl Default for ViewImage {
    fn default() -> Self {
        Self {
            max_source_bytes: corral_proto::limits::MAX_FILE_BYTES,
            max_source_pixels: 32_000_000,
            max_width: 2000,
            max_height: 2000,
            max_base64_bytes: 4_999_000,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    path: String,
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::Png => "PNG",
        ImageFormat::WebP => "WebP",
        ImageFormat::Bmp => "BMP",
        ImageFormat::Tiff => "TIFF",
        _ => "unsupported",
    }
}

impl ViewImage {
    /// Decodes, scales and encodes `data`; returns the metadata line and
    /// the data URL.
    pub fn prepare(&self, path: &str, data: &[u8]) -> Result<(String, String), String> {
        let reader = ImageReader::new(Cursor::new(data))
            .with_guessed_format()
            .map_err(|e| format!("{path}: {e}"))?;
        let format = match reader.format() {
            Some(
                f @ (ImageFormat::Jpeg
                | ImageFormat::Png
                | ImageFormat::WebP
                | ImageFormat::Bmp
                | ImageFormat::Tiff),
            ) => f,
            Some(other) => {
                return Err(format!(
                    "{path}: {} images are not supported (JPEG, PNG, WebP, BMP and TIFF are)",
                    other
                        .extensions_str()
                        .first()
                        .copied()
                        .unwrap_or("this kind of")
                        .to_uppercase()
                ));
            }
            None => {
                return Err(format!(
                    "{path}: not an image this tool can read (JPEG, PNG, WebP, BMP, TIFF)"
                ));
            }
        };
        let (w, h) = reader
            .into_dimensions()
            .map_err(|e| format!("{path}: {e}"))?;
        let pixels = u64::from(w) * u64::from(h);
        if pixels > self.max_source_pixels {
            return Err(format!(
                "{path}: {w}x{h} is {pixels} pixels; the limit is {}",
                self.max_source_pixels
            ));
        }
        let mut reader = ImageReader::with_format(Cursor::new(data), format);
        let mut limits = Limits::default();
        limits.max_alloc = Some(self.max_source_pixels * 8);
        reader.limits(limits);
        let img = reader
            .decode()
            .map_err(|e| format!("{path}: cannot decode: {e}"))?;
        let scale = (f64::from(self.max_width) / f64::from(w))
            .min(f64::from(self.max_height) / f64::from(h))
            .min(1.0);
        let (nw, nh) = (
            ((f64::from(w) * scale).round() as u32).max(1),
            ((f64::from(h) * scale).round() as u32).max(1),
        );
        let scaled = (nw, nh) != (w, h);
        let (bytes, mime) = if format == ImageFormat::Jpeg && !scaled {
            (data.to_vec(), "image/jpeg")
        } else {
            let img = if scaled {
                img.resize_exact(nw, nh, image::imageops::FilterType::Triangle)
            } else {
                img
            };
            let mut out = Cursor::new(Vec::new());
            if format == ImageFormat::Jpeg {
                let enc = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90);
                img.to_rgb8()
                    .write_with_encoder(enc)
                    .map_err(|e| format!("{path}: encoding: {e}"))?;
                (out.into_inner(), "image/jpeg")
            } else {
                img.write_to(&mut out, ImageFormat::Png)
                    .map_err(|e| format!("{path}: encoding: {e}"))?;
                (out.into_inner(), "image/png")
            }
        };
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        if b64.len() > self.max_base64_bytes {
            return Err(format!(
                "{path}: the image needs {} base64 bytes; the limit is {} (over by {})",
                b64.len(),
                self.max_base64_bytes,
                b64.len() - self.max_base64_bytes
            ));
        }
        let mut meta = format!("Image {path}: {} {w}x{h}", format_name(format));
        if scaled {
            meta.push_str(&format!(
                ", shown at {nw}x{nh} (multiply coordinates by {:.4} for the original)",
                f64::from(w) / f64::from(nw)
            ));
        }
        Ok((meta, format!("data:{mime};base64,{b64}")))
    }
}

impl Translator for ViewImage {
    fn tool(&self) -> Tool {
        Tool {
            name: "ViewImage".into(),
            description:
                "Look at an image file in the sandbox (JPEG, PNG, WebP, BMP or TIFF). Large images \
are scaled down to fit; the result says by how much."
                    .into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Relative to the workspace, or absolute under the workspace or /tmp."}},
                "required": ["path"],
                "additionalProperties": false
            }),
        }
    }

    fn translate(&self, arguments: &str) -> CallStatus {
        let args: Args = match parse_args("ViewImage", arguments) {
            Ok(a) => a,
            Err(e) => return CallStatus::Error(e),
        };
        let spec = OperationSpec::ReadFile(ReadFileSpec {
            // One byte more than allowed, to tell "too big" from "exactly at the limit".
            limit: (self.max_source_bytes + 1).min(corral_proto::limits::MAX_FILE_BYTES),
            ..ReadFileSpec::new(args.path)
        });
        CallStatus::Submit(vec![spec])
    }

    fn render(&self, ops: &[OpView<'_>]) -> Vec<ToolOutput> {
        let Some(op) = ops.first() else {
            return text("Error: not started");
        };
        if let Some(t) = super::files::not_done(op) {
            return t;
        }
        let (Some(r), OperationSpec::ReadFile(spec)) = (op.result, op.spec) else {
            return text("Error: no result");
        };
        if r.file_size > self.max_source_bytes || (r.file_data.len() as u64) < r.file_size {
            return text(format!(
                "Error: {} is {} bytes; the limit is {} bytes",
                spec.path, r.file_size, self.max_source_bytes
            ));
        }
        match self.prepare(&spec.path, &r.file_data) {
            Ok((meta, url)) => vec![
                ToolOutput::Text { text: meta.into() },
                ToolOutput::Image {
                    data_url: url.into(),
                },
            ],
            Err(e) => text(format!("Error: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x % 256) as u8, (y % 256) as u8, 7])
        });
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn jpeg(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, _| image::Rgb([(x % 256) as u8, 50, 90]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Jpeg).unwrap();
        out.into_inner()
    }

    fn decode(url: &str) -> image::DynamicImage {
        let b64 = url.split_once(",").unwrap().1;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        image::load_from_memory(&bytes).unwrap()
    }

    #[test]
    fn a_large_image_is_scaled_to_fit_and_says_so() {
        let (meta, url) = ViewImage::default()
            .prepare("shot.png", &png(3000, 1500))
            .unwrap();
        assert_eq!(
            meta,
            "Image shot.png: PNG 3000x1500, shown at 2000x1000 (multiply coordinates by 1.5000 for the original)"
        );
        assert!(url.starts_with("data:image/png;base64,"));
        let img = decode(&url);
        assert_eq!((img.width(), img.height()), (2000, 1000));
    }

    #[test]
    fn a_small_jpeg_is_passed_through_untouched() {
        let data = jpeg(64, 32);
        let (meta, url) = ViewImage::default().prepare("a.jpg", &data).unwrap();
        assert_eq!(meta, "Image a.jpg: JPEG 64x32");
        let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
        assert_eq!(url, format!("data:image/jpeg;base64,{b64}"));
    }

    #[test]
    fn webp_bmp_and_tiff_are_read_too() {
        let img = image::RgbImage::from_fn(40, 30, |x, y| image::Rgb([x as u8, y as u8, 1]));
        for (format, name) in [
            (ImageFormat::WebP, "WebP"),
            (ImageFormat::Bmp, "BMP"),
            (ImageFormat::Tiff, "TIFF"),
        ] {
            let mut out = Cursor::new(Vec::new());
            img.write_to(&mut out, format).unwrap();
            let (meta, url) = ViewImage::default().prepare("i", out.get_ref()).unwrap();
            assert_eq!(meta, format!("Image i: {name} 40x30"));
            assert!(
                url.starts_with("data:image/png;base64,"),
                "{name} is re-encoded as PNG"
            );
            assert_eq!(decode(&url).width(), 40);
        }
    }

    #[test]
    fn refusals_are_clear() {
        let v = ViewImage {
            max_source_pixels: 1000,
            ..ViewImage::default()
        };
        assert_eq!(
            v.prepare("big.png", &png(100, 100)).unwrap_err(),
            "big.png: 100x100 is 10000 pixels; the limit is 1000"
        );
        let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;";
        let e = ViewImage::default().prepare("x.gif", gif).unwrap_err();
        assert!(e.contains("GIF images are not supported"), "{e}");
        let e = ViewImage::default()
            .prepare("notes.txt", b"hello")
            .unwrap_err();
        assert!(e.contains("not an image"), "{e}");
        let tiny = ViewImage {
            max_base64_bytes: 10,
            ..ViewImage::default()
        };
        let e = tiny.prepare("p.png", &png(8, 8)).unwrap_err();
        assert!(e.contains("base64 bytes; the limit is 10"), "{e}");
        assert!(matches!(
            ViewImage::default().translate("{}"),
            CallStatus::Error(_)
        ));
    }
}
