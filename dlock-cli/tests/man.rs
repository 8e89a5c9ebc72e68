//! The man pages in `dlock-cli/man/` are made from the same definition as `--help`: this test
//! fails when they are not current. `DLOCK_BLESS=1 cargo test -p dlock-cli --test man` writes
//! them anew.

use std::path::PathBuf;

/// Each page: `dlock.1`, and `dlock-<subcommand>.1` for each subcommand.
fn pages() -> Vec<(String, Vec<u8>)> {
    let command = dlock_cli::cli::command();
    let mut pages = Vec::new();
    let mut render = |name: String, command: clap::Command| {
        let mut page = Vec::new();
        clap_mangen::Man::new(command)
            .render(&mut page)
            .expect("a man page renders");
        pages.push((format!("{name}.1"), page));
    };
    for sub in command.get_subcommands() {
        let name = format!("dlock-{}", sub.get_name());
        let leaked: &'static str = name.clone().leak();
        render(name, sub.clone().name(leaked));
    }
    render("dlock".to_owned(), command);
    pages
}

#[test]
fn the_man_pages_are_current() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("man");
    let bless = std::env::var_os("DLOCK_BLESS").is_some();
    let mut stale = Vec::new();
    for (name, page) in pages() {
        let path = dir.join(&name);
        if bless {
            std::fs::write(&path, &page).expect("write a man page");
        } else if std::fs::read(&path).ok().as_deref() != Some(&page[..]) {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "the man pages {stale:?} are not current: run `DLOCK_BLESS=1 cargo test -p dlock-cli --test man`"
    );
}
