//! Shape rules the review holds the code to, checked so they stay held: no function in the core
//! or the Wasmtime integration is longer than 80 lines (one seam per lifecycle: a function that
//! long is several steps that want names of their own); no crate reads a file outside its own
//! package; no model file is longer than 800 lines; no race case sleeps.

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
        // A declaration without a body (a trait's required method, its signature on one line
        // or several), or a one-line body.
        let signature_end = lines[i..]
            .iter()
            .map(|l| l.trim_end())
            .find(|l| l.ends_with(';') || l.ends_with('{') || l.ends_with('}'));
        if signature_end.is_none_or(|l| l.ends_with(';') || l.ends_with('}')) {
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
    let root = tensor_wasm_mem_tests::workspace_root();
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

/// The simulated driver is split by concern: no file of the model over 800 lines.
#[test]
fn no_model_file_is_longer_than_800_lines() {
    let root = tensor_wasm_mem_tests::workspace_root();
    let mut files = Vec::new();
    rust_files(&root.join("backends/model/src"), &mut files);
    assert!(files.len() > 5, "the sources were found");
    let long: Vec<_> = files
        .iter()
        .map(|f| (f, std::fs::read_to_string(f).expect("read").lines().count()))
        .filter(|(_, lines)| *lines > 800)
        .collect();
    assert!(long.is_empty(), "model files over 800 lines: {long:?}");
}

/// Races are staged by the model's holds, released by the test, never by time.
#[test]
fn no_race_case_sleeps() {
    let races = tensor_wasm_mem_tests::package_dir().join("src/races.rs");
    let source = std::fs::read_to_string(races).expect("read");
    assert!(!source.contains("sleep("), "a race case sleeps");
    assert!(
        source.contains("hold_next"),
        "the checked file stages races"
    );
}

#[test]
fn the_checker_sees_a_long_function() {
    let long = format!("fn long() {{\n{}}}\n", "    let _ = 1;\n".repeat(LONGEST));
    let short = "    pub(crate) unsafe fn short(&self) {\n        body();\n    }\n";
    let found = long_functions(Path::new("x.rs"), &format!("{long}{short}"));
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].2.as_str(), found[0].3), ("long", LONGEST + 2));
}

/// The workspace's member folders, from its manifest.
fn members(root: &Path) -> Vec<PathBuf> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("workspace manifest");
    let list = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .expect("a members list")
        .0;
    list.split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| root.join(m))
        .collect()
}

/// Every `#[path = ..]`, `include_str!` or `include_bytes!` in `source` (a file of the package
/// at `package`) that names a file outside that package (or inside a package nested in it,
/// which cargo leaves out of its package), except under `#[cfg(doctest)]` (doc tests of the
/// workspace README, never built from a package).
fn reaches_outside(package: &Path, nested: &[PathBuf], file: &Path, source: &str) -> Vec<String> {
    let package = package.canonicalize().expect("package folder");
    let mut found = Vec::new();
    let mut previous = "";
    for line in source.lines() {
        for marker in ["#[path = \"", "include_str!(\"", "include_bytes!(\""] {
            let Some((_, rest)) = line.split_once(marker) else {
                continue;
            };
            let named = rest.split('"').next().unwrap_or_default();
            let base = file.parent().expect("a folder");
            let target = base.join(named);
            let inside = target
                .canonicalize()
                .is_ok_and(|t| t.starts_with(&package) && !nested.iter().any(|n| t.starts_with(n)));
            // Doc tests of files outside the package are compiled only as doc tests.
            let doctest_only = previous.trim().starts_with("#[cfg(")
                && previous.contains("doctest")
                && !previous.contains("not(doctest)");
            if !inside && !doctest_only {
                found.push(format!("{}: {}", file.display(), line.trim()));
            }
        }
        previous = line;
    }
    found
}

/// A crate is built from its own package: a packaged crate (what `cargo package` verifies and
/// crates.io serves) has no files beside it, so no source may name one. Build scripts find
/// their inputs from their build's environment at run time, never from a path compiled in.
#[test]
fn every_crate_reads_only_its_own_package() {
    let root = tensor_wasm_mem_tests::workspace_root()
        .canonicalize()
        .expect("workspace");
    let members = members(&root);
    assert!(members.len() > 8, "the members were found: {members:?}");
    let mut outside = Vec::new();
    for member in &members {
        let mut files = Vec::new();
        rust_files(member, &mut files);
        for file in files {
            // A nested member's files are that member's.
            let owner = members
                .iter()
                .filter(|m| file.starts_with(m))
                .max_by_key(|m| m.components().count());
            if owner != Some(member) || file.components().any(|c| c.as_os_str() == "target") {
                continue;
            }
            let source = std::fs::read_to_string(&file).expect("read");
            let nested: Vec<PathBuf> = members
                .iter()
                .filter(|m| *m != member && m.starts_with(member))
                .cloned()
                .collect();
            outside.extend(reaches_outside(member, &nested, &file, &source));
            if file.file_name().is_some_and(|n| n == "build.rs") && source.contains("env!(") {
                outside.push(format!(
                    "{}: a path compiled into a build script",
                    file.display()
                ));
            }
        }
    }
    assert!(
        outside.is_empty(),
        "sources that reach outside their package: {outside:#?}"
    );
}

/// Every `env!("CARGO_MANIFEST_DIR")` in the code of `source` (not its comments) that is not
/// the fallback of a run-time lookup (`var_os("CARGO_MANIFEST_DIR")` on one of the three lines
/// before it).
fn compiled_in_package_dirs(file: &Path, source: &str) -> Vec<String> {
    let lines: Vec<&str> = source.lines().collect();
    let compiled = concat!("env!(\"CARGO_", "MANIFEST_DIR\")");
    let looked_up = concat!("var_os(\"CARGO_", "MANIFEST_DIR\")");
    (0..lines.len())
        .filter(|&i| lines[i].contains(compiled) && !lines[i].trim_start().starts_with("//"))
        .filter(|&i| {
            !lines[i.saturating_sub(3)..=i]
                .iter()
                .any(|l| l.contains(looked_up))
        })
        .map(|i| format!("{}:{}: {}", file.display(), i + 1, lines[i].trim()))
        .collect()
}

/// Two checkouts that share a target directory share compiled test binaries (cargo gives a
/// workspace member the same artifact wherever its checkout is): a path compiled into one names
/// the checkout that built it, which may be gone. Files are found from `CARGO_MANIFEST_DIR` at
/// run time (`package_dir`, `workspace_root`), the compiled-in value only where it is unset.
#[test]
fn no_test_finds_its_files_by_a_path_compiled_in() {
    let root = tensor_wasm_mem_tests::workspace_root();
    let mut found = Vec::new();
    for member in members(&root) {
        let mut files = Vec::new();
        rust_files(&member, &mut files);
        for file in files {
            if file.components().any(|c| c.as_os_str() == "target") {
                continue;
            }
            let source = std::fs::read_to_string(&file).expect("read");
            found.extend(compiled_in_package_dirs(&file, &source));
        }
    }
    assert!(found.is_empty(), "paths compiled in: {found:#?}");
    // The checker sees one.
    let baked = concat!("let p = env!(\"CARGO_", "MANIFEST_DIR\");\n");
    let looked_up = concat!(
        "let p = std::env::var_os(\"CARGO_",
        "MANIFEST_DIR\")\n    .unwrap_or(env!(\"CARGO_",
        "MANIFEST_DIR\").into());\n"
    );
    assert_eq!(compiled_in_package_dirs(Path::new("x.rs"), baked).len(), 1);
    assert!(compiled_in_package_dirs(Path::new("x.rs"), looked_up).is_empty());
}

#[test]
fn the_package_check_sees_a_file_outside() {
    let root = &tensor_wasm_mem_tests::package_dir();
    let nested = [root.join("cuda-sim").canonicalize().expect("cuda-sim")];
    let file = root.join("src/sim.rs");
    let outside = "#[path = \"../../core/src/lib.rs\"]\nmod x;\n";
    let in_nested = "#[path = \"../cuda-sim/src/lib.rs\"]\nmod x;\n";
    let inside = "#[path = \"harness.rs\"]\nmod y;\n";
    assert_eq!(reaches_outside(root, &nested, &file, outside).len(), 1);
    assert_eq!(reaches_outside(root, &nested, &file, in_nested).len(), 1);
    assert!(reaches_outside(root, &nested, &file, inside).is_empty());
}
