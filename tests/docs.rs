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

/// The cases of the conformance suite: the names `conformance_suite!` makes a test of (its
/// `@cases` list and its `@sync_case` lines), read from the macro's source.
fn conformance_cases() -> usize {
    let source = read("dlock-testkit/src/conformance.rs");
    let all = source
        .find("(@all $mode:ident")
        .expect("the suite's @all arm");
    let arm = &source[all..];
    let arm = &arm[..arm.find("\n    };").expect("the end of the @all arm")];
    let mut cases = 0;
    for part in arm.split("$make;").skip(1) {
        let list = &part[..part.find(')').expect("a case list ends")];
        cases += list
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|name| !name.is_empty())
            .count();
    }
    cases
}

/// The tests a test file's binary runs: its `#[test]` and `#[tokio::test]` functions and one
/// test per case for each `conformance_suite!`, with the file's own `macro_rules!` expanded
/// once per invocation (a macro that makes a module of tests per flavour), and those of the
/// files of its modules (`mod support;`).
fn tests_in(file: &str) -> usize {
    fn code(text: &str) -> impl Iterator<Item = &str> {
        text.lines()
            .map(str::trim_start)
            .filter(|line| !line.starts_with("//"))
    }
    let count = |text: &str| {
        code(text)
            .filter(|line| line.starts_with("#[test]") || line.starts_with("#[tokio::test"))
            .count()
            + code(text)
                .filter(|line| line.contains("conformance_suite!("))
                .count()
                * conformance_cases()
    };
    // A macro's body ends at the first line that closes it at its own indentation (as
    // rustfmt writes it; braces in its strings, such as ACL patterns, are not counted).
    let text = read(file);
    let mut rest = String::new();
    let mut macros = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line.trim_start().strip_prefix("macro_rules! ") else {
            rest.push_str(line);
            rest.push('\n');
            continue;
        };
        let name = name.trim_end_matches(['{', ' ']).to_owned();
        let close = format!("{}}}", &line[..line.len() - line.trim_start().len()]);
        let mut body = String::new();
        for line in lines.by_ref() {
            if line == close {
                break;
            }
            body.push_str(line);
            body.push('\n');
        }
        macros.push((name, count(&body)));
    }
    let mut total = count(&rest);
    // The files of its modules (`mod support;`): their tests are in this binary too.
    let path = Path::new(file);
    let dir = if path.file_name().is_some_and(|name| name == "mod.rs")
        || path.parent() == Some(Path::new("tests"))
    {
        path.parent().unwrap_or(Path::new("")).to_path_buf()
    } else {
        path.with_extension("")
    };
    for line in code(&rest) {
        let Some(name) = line
            .trim_start_matches("pub ")
            .trim_start_matches("pub(crate) ")
            .strip_prefix("mod ")
            .and_then(|rest| rest.strip_suffix(';'))
        else {
            continue;
        };
        let flat = dir.join(format!("{name}.rs"));
        let nested = dir.join(name).join("mod.rs");
        let module = if root().join(&flat).is_file() {
            flat
        } else {
            nested
        };
        total += tests_in(module.to_str().expect("a UTF-8 path"));
    }
    for (name, each) in macros {
        let calls = code(&rest)
            .filter(|line| line.starts_with(&format!("{name}!")))
            .count();
        total += calls * each;
    }
    total
}

/// The counts RELIABILITY.md quotes, checked against the code: every `N cases` is the
/// conformance suite's number of cases, and every `N tests` (or `N live tests`) is the number
/// of tests in the test files named before it in its paragraph or table row (since the
/// previous count there), or in its table's header. A count with no file named is refused:
/// quote only what this test can check.
#[test]
fn reliability_quotes_the_counts_of_the_code() {
    let text = read("RELIABILITY.md");
    let cases = conformance_cases();
    // Paragraphs and table rows, a row with its table's header.
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut header = String::new();
    let mut paragraph = String::new();
    for line in text.lines() {
        if line.starts_with('|') {
            if !paragraph.is_empty() {
                blocks.push((String::new(), std::mem::take(&mut paragraph)));
            }
            if line.starts_with("|---") {
                continue;
            }
            if header.is_empty() {
                header = line.to_owned();
            } else {
                blocks.push((header.clone(), line.to_owned()));
            }
        } else {
            header.clear();
            if line.trim().is_empty() {
                if !paragraph.is_empty() {
                    blocks.push((String::new(), std::mem::take(&mut paragraph)));
                }
            } else {
                paragraph.push_str(line);
                paragraph.push(' ');
            }
        }
    }
    blocks.push((String::new(), paragraph));
    let files = |text: &str| -> Vec<String> {
        text.split('`')
            .skip(1)
            .step_by(2)
            .filter(|span| span.starts_with("tests/") && span.ends_with(".rs"))
            .map(str::to_owned)
            .collect()
    };
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (header, block) in &blocks {
        let words: Vec<&str> = block.split(' ').collect();
        let mut since = String::new();
        for (i, word) in words.iter().enumerate() {
            since.push_str(word);
            since.push(' ');
            let number = word.trim_start_matches('(').replace(',', "");
            let Ok(number) = number.parse::<usize>() else {
                continue;
            };
            let next = words.get(i + 1).copied().unwrap_or("");
            let next = if next == "live" {
                words.get(i + 2).copied().unwrap_or("")
            } else {
                next
            };
            let noun = next.trim_end_matches(|c: char| !c.is_alphabetic());
            match noun {
                "cases" => {
                    checked += 1;
                    if number != cases {
                        wrong.push(format!(
                            "`{number} cases`: the conformance suite has {cases} ({})",
                            excerpt(block, word)
                        ));
                    }
                }
                "tests" => {
                    checked += 1;
                    let mut named = files(&since);
                    if named.is_empty() {
                        named = files(header);
                    }
                    if named.is_empty() {
                        wrong.push(format!(
                            "`{number} tests` names no test file before it ({})",
                            excerpt(block, word)
                        ));
                        continue;
                    }
                    let actual: usize = named.iter().map(|file| tests_in(file)).sum();
                    if number != actual {
                        wrong.push(format!(
                            "`{number} tests`: {} have {actual} ({})",
                            named.join(" + "),
                            excerpt(block, word)
                        ));
                    }
                    since.clear();
                }
                _ => {}
            }
        }
    }
    assert!(checked > 0, "RELIABILITY.md quotes no count any more");
    assert!(
        wrong.is_empty(),
        "RELIABILITY.md's counts disagree with the code:\n{}",
        wrong.join("\n")
    );
}

/// About 80 characters of `block` around `word`.
fn excerpt(block: &str, word: &str) -> String {
    let at = block.find(word).unwrap_or(0);
    let start = block[..at]
        .char_indices()
        .rev()
        .nth(40)
        .map_or(0, |(i, _)| i);
    block[start..].chars().take(90).collect()
}
