//! Shape rules the review holds the code to, checked so they stay held: no function in the core
//! or the Wasmtime integration is longer than 80 lines (one seam per lifecycle: a function that
//! long is several steps that want names of their own).

use std::path::{Path, PathBuf};

const LONGEST: usize = 80;

/// `(file, first line, name, lines)` of every function in `source` longer than [`LONGEST`]
/// lines, in rustfmt's layout: a function ends at the first line that closes it at its own
/// indentation.
fn long_functions(file: &Path, source: &str) -> Vec<(PathBuf, usize, String, usize)> {
    let lines: Vec<&str> = source.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = function_name(line) else {
            continue;
        };
        let indent = &line[..line.len() - line.trim_start().len()];
        let closing = format!("{indent}}}");
        // A declaration without a body (a trait's required method), or a one-line body.
        if line.trim_end().ends_with(';') || line.trim_end().ends_with('}') {
            continue;
        }
        let Some(end) = lines[i + 1..].iter().position(|l| *l == closing) else {
            continue;
        };
        let length = end + 2;
        if length > LONGEST {
            found.push((file.to_path_buf(), i + 1, name, length));
        }
    }
    found
}

/// The function a line begins, if it does (`pub`, `const`, `async`, `unsafe`, `extern` first).
fn function_name(line: &str) -> Option<String> {
    let mut rest = line.trim_start();
    loop {
        let before = rest;
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        if let Some(after) = rest.strip_prefix("extern \"") {
            rest = after.split_once("\" ").map_or(after, |(_, r)| r);
        }
        if rest == before {
            break;
        }
    }
    let rest = rest.strip_prefix("fn ")?;
    let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_'))?;
    Some(rest[..end].to_string())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_function_in_the_core_or_the_integration_is_longer_than_80_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["core/src", "integrations/wasmtime/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 20, "the sources were found");
    let long: Vec<_> = files
        .iter()
        .flat_map(|f| long_functions(f, &std::fs::read_to_string(f).expect("read")))
        .collect();
    assert!(long.is_empty(), "functions over {LONGEST} lines: {long:#?}");
}

#[test]
fn the_checker_sees_a_long_function() {
    let long = format!("fn long() {{\n{}}}\n", "    let _ = 1;\n".repeat(LONGEST));
    let short = "    pub(crate) unsafe fn short(&self) {\n        body();\n    }\n";
    let found = long_functions(Path::new("x.rs"), &format!("{long}{short}"));
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].2.as_str(), found[0].3), ("long", LONGEST + 2));
}
