//! Small helpers for reading model files; every error names the file.

use super::ModelError;
use serde_json::Value;
use std::path::Path;

/// Reads and parses a JSON file; errors name the file.
pub(crate) fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ModelError::file(path, "missing file")
        } else {
            ModelError::file(path, format!("cannot read: {e}"))
        }
    })?;
    serde_json::from_str(&text)
        .map_err(|e| ModelError::file(path, format!("unparseable JSON: {e}")))
}
