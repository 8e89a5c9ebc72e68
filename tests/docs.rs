//! The README and the pages of `docs/` say what the code does: the backend table is the one on
//! the `dlock` crate's front page, the core-API snippet is `dlock/examples/quickstart.rs`, the
//! minimum Rust version is the workspace's, and every relative link leads somewhere.
//! (The README's Rust snippets are compiled as doctests in `dlock-axum`, and its demo is run
//! by `.ci/readme-demo.sh`.)

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|err| panic!("{path}: {err}"))
}

#[test]
fn the_readme_and_the_crate_docs_show_one_backend_table() {
    let table = read("dlock/src/backends.md");
    assert!(table.starts_with("| backend |"), "{table}");
    assert!(
        read("README.md").contains(table.trim_end()),
        "the README's backend table is not dlock/src/backends.md (the crate's front page \
         includes that file): copy it over"
    );
    assert!(
        read("dlock/src/lib.rs").contains("#![doc = include_str!(\"backends.md\")]"),
        "the crate's front page no longer includes the table"
    );
}

#[test]
fn the_quickstart_example_is_the_readmes_core_snippet() {
    let example = read("dlock/examples/quickstart.rs");
    let code: String = example
        .lines()
        .skip_while(|line| line.starts_with("//!") || line.is_empty())
        .map(|line| format!("{line}\n"))
        .collect();
    assert!(code.contains("LockProvider::connect"), "{code}");
    assert!(
        read("README.md").contains(&format!("```rust,no_run\n{code}```")),
        "the README's core-API snippet is not dlock/examples/quickstart.rs (less its header)"
    );
}

#[test]
fn the_readme_names_the_minimum_rust_version() {
    let manifest = read("Cargo.toml");
    let version = manifest
        .lines()
        .find_map(|line| line.strip_prefix("rust-version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("rust-version in Cargo.toml");
    assert!(
        read("README.md").contains(&format!("Rust {version} or later")),
        "the README does not say `Rust {version} or later`"
    );
}

/// The `#anchor`s GitHub makes of a page's headings.
fn anchors(text: &str) -> Vec<String> {
    text.lines()
        .filter(|line| line.starts_with('#'))
        .map(|line| {
            line.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// The targets of the Markdown links `[text](target)` in `text` outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            found.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    found
}

#[test]
fn every_relative_link_of_the_readme_and_the_docs_leads_somewhere() {
    let mut pages = vec![PathBuf::from("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).expect("docs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(
                path.strip_prefix(root())
                    .expect("in the root")
                    .to_path_buf(),
            );
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = read(page.to_str().expect("UTF-8"));
        let dir = page.parent().unwrap_or(Path::new(""));
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            if !root().join(&target).exists() {
                broken.push(format!(
                    "{}: {link} (no {})",
                    page.display(),
                    target.display()
                ));
                continue;
            }
            if !anchor.is_empty() {
                let target_text = read(target.to_str().expect("UTF-8"));
                if !anchors(&target_text).iter().any(|a| a == anchor) {
                    broken.push(format!("{}: {link} (no heading #{anchor})", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
