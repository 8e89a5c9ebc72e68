//! Lock key templates such as `"account:{account_id}"`, and the encoding of the values put
//! into them.
//!
//! The attribute macro and the axum layer build keys from a template and values that come
//! from arguments, struct fields or path parameters. Both use this module, so one template
//! rendered from the same values gives the same key. The values are not always the same: the
//! macro formats an argument's parsed value (`42` for a `u64` however the request spelled it),
//! while the layer's template (`dlock_axum::LockLayer::new`) renders the text of the path
//! (`042` for `/accounts/042`). They agree for `String` parameters; for typed ones the layer
//! makes its key from the handler's extractor (`dlock_axum::LockLayer::with_extractor`).
//!
//! # Template syntax
//!
//! | in the template | means |
//! |---|---|
//! | `{name}` or `<name>` | the value of `name`, [encoded](encode_component) |
//! | `{{` `}}` `<<` `>>` | a literal `{` `}` `<` `>` |
//! | anything else | itself |
//!
//! A name is a Rust identifier (Unicode letters included; `r#type` is the name `type`) or a
//! tuple index, optionally followed by `.` and more of them (`{cmd.account_id}` lets the
//! macro reach into a parameter); spaces around it and around each `.` are ignored. A lone
//! `}` or `>`, an unclosed placeholder or an empty or malformed name is an error, so a typo
//! never silently becomes part of every key. Two placeholders must have a `:` (or `{` `}` `<`
//! `>`, or a control character) between them: `"{a}-{b}"` is an error, because
//! `("x-y", "z")` and `("x", "y-z")` would render to the same key.
//!
//! The grammar and the encoding live in the `dlock_template` crate, which the attribute
//! macro parses with too: its documentation gives the full rules and why they make keys
//! injective.
//!
//! # Why values are encoded
//!
//! Without encoding, `"{a}:{b}"` renders `a = "x:y", b = "z"` and `a = "x", b = "y:z"` to the
//! same key `x:y:z`, and two requests that should not exclude each other would. Encoding `:`,
//! `%`, the brace and angle characters and control characters in values (as `%XX`, uppercase,
//! of their UTF-8 bytes) makes the rendering injective: distinct values always give distinct
//! keys.
//!
//! ```
//! use dlock::key_template::KeyTemplate;
//!
//! let template = KeyTemplate::parse("account:{account_id}").unwrap();
//! let key = template
//!     .render(|name| (name == "account_id").then_some("42:7"))
//!     .unwrap();
//! assert_eq!(key, "account:42%3A7");
//! ```

use std::fmt;

pub use dlock_template::{KeyBuilder, encode_component};
use dlock_template::{ParseError, Template};

/// A parsed lock key template such as `"account:{account_id}"`.
///
/// See the [module documentation](self) for the syntax. Parse once, render per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyTemplate {
    source: String,
    template: Template,
}

/// What is wrong with a key template, or why it could not be rendered.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TemplateError {
    /// A `{` or `<` at byte `position` has no matching `}` or `>`.
    Unclosed {
        /// Byte offset of the opening character.
        position: usize,
    },
    /// A `}` or `>` at byte `position` closes nothing (write `}}` or `>>` for the character).
    Unopened {
        /// Byte offset of the character.
        position: usize,
    },
    /// The placeholder at byte `position` has an empty name, or one that is not a Rust
    /// identifier or tuple index optionally followed by `.` and more of them.
    BadName {
        /// Byte offset of the opening character.
        position: usize,
        /// The name as written.
        name: String,
    },
    /// Two placeholders are not separated by a `:` (or another character that values never
    /// contain unencoded: `{` `}` `<` `>` or a control character), so distinct values could
    /// render to the same key (`"ab"` + `"c"` and `"a"` + `"bc"`).
    NoSeparator {
        /// Byte offset of the second placeholder.
        position: usize,
    },
    /// [`KeyTemplate::render`] found no value for this placeholder.
    Missing {
        /// The placeholder's name.
        name: String,
    },
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateError::Unclosed { position } => write!(
                f,
                "the placeholder opened at byte {position} is not closed \
                 (write `{{{{` or `<<` for a literal `{{` or `<`)"
            ),
            TemplateError::Unopened { position } => write!(
                f,
                "the `}}` or `>` at byte {position} closes nothing \
                 (write `}}}}` or `>>` for a literal `}}` or `>`)"
            ),
            TemplateError::BadName { position, name } => write!(
                f,
                "the placeholder at byte {position} has the name `{}`; a name is an \
                 identifier or tuple index, optionally followed by `.field`s",
                name.escape_debug()
            ),
            TemplateError::NoSeparator { position } => write!(
                f,
                "the placeholder at byte {position} needs a `:` between it and the one before: \
                 without one, distinct values could give the same key"
            ),
            TemplateError::Missing { name } => {
                write!(f, "no value for the placeholder `{}`", name.escape_debug())
            }
        }
    }
}

impl std::error::Error for TemplateError {}

impl From<ParseError> for TemplateError {
    fn from(err: ParseError) -> Self {
        match err {
            ParseError::Unclosed { position, .. } => TemplateError::Unclosed { position },
            ParseError::Unopened { position, .. } => TemplateError::Unopened { position },
            ParseError::EmptyName { position, .. } => TemplateError::BadName {
                position,
                name: String::new(),
            },
            ParseError::BadName { position, name, .. } => TemplateError::BadName { position, name },
            ParseError::NoSeparator { position, .. } => TemplateError::NoSeparator { position },
        }
    }
}

impl From<TemplateError> for crate::LockError {
    fn from(err: TemplateError) -> Self {
        crate::LockError::config(format!("lock key template: {err}"))
    }
}

impl KeyTemplate {
    /// Parses `template`.
    ///
    /// ```
    /// use dlock::key_template::{KeyTemplate, TemplateError};
    ///
    /// let t = KeyTemplate::parse("{{literal}}:<id>:{tenant.id}").unwrap();
    /// assert_eq!(t.placeholders().collect::<Vec<_>>(), ["id", "tenant.id"]);
    /// assert_eq!(
    ///     KeyTemplate::parse("account:{id"),
    ///     Err(TemplateError::Unclosed { position: 8 })
    /// );
    /// ```
    pub fn parse(template: &str) -> Result<KeyTemplate, TemplateError> {
        Ok(KeyTemplate {
            source: template.to_owned(),
            template: Template::parse(template)?,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The placeholder names, in order of appearance (repeated names appear repeatedly).
    pub fn placeholders(&self) -> impl Iterator<Item = &str> + '_ {
        self.template
            .placeholders()
            .map(|placeholder| placeholder.name())
    }

    /// Renders the key: each placeholder becomes `value(name)`, passed through
    /// [`encode_component`]; literals are copied as written (after unescaping `{{` and the
    /// like). Fails with [`TemplateError::Missing`] when `value` returns `None`.
    ///
    /// ```
    /// use dlock::key_template::KeyTemplate;
    ///
    /// let t = KeyTemplate::parse("transfer:{from}->>{to}").unwrap();
    /// let key = t.render(|name| match name {
    ///     "from" => Some("a"),
    ///     "to" => Some("b:c"),
    ///     _ => None,
    /// });
    /// assert_eq!(key.unwrap(), "transfer:a->b%3Ac");
    /// ```
    pub fn render<F, V>(&self, mut value: F) -> Result<String, TemplateError>
    where
        F: FnMut(&str) -> Option<V>,
        V: AsRef<str>,
    {
        self.template
            .render(|placeholder| value(placeholder.name()))
            .map_err(|missing| TemplateError::Missing {
                name: missing.name().to_owned(),
            })
    }
}

impl fmt::Display for KeyTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl std::str::FromStr for KeyTemplate {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KeyTemplate::parse(s)
    }
}

#[cfg(test)]
mod tests {
    // The grammar's and the encoding's own tests are in `dlock_template`; these hold the
    // library's wrapper: its errors, positions and names.
    use super::*;

    fn render(template: &str, pairs: &[(&str, &str)]) -> Result<String, TemplateError> {
        KeyTemplate::parse(template)?.render(|name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, value)| *value)
        })
    }

    #[test]
    fn distinct_values_give_distinct_keys() {
        let values = [
            "x", "x:y", "y", "y:z", "z", ":", "%3A", "%", "", "{y}", "<y>",
        ];
        let mut seen = std::collections::HashSet::new();
        for a in values {
            for b in values {
                let key = render("{a}:{b}", &[("a", a), ("b", b)]).unwrap();
                assert!(seen.insert(key.clone()), "{a:?} {b:?} collided on {key:?}");
            }
        }
    }

    #[test]
    fn parses_both_spellings_and_escapes() {
        assert_eq!(
            render("account:{id}", &[("id", "42")]).unwrap(),
            "account:42"
        );
        assert_eq!(
            render("account:<id>", &[("id", "42")]).unwrap(),
            "account:42"
        );
        assert_eq!(
            render("{{{id}}}<<<id>>>", &[("id", "7")]).unwrap(),
            "{7}<7>"
        );
        assert_eq!(
            render("{a}:{ b }", &[("a", "1"), ("b", "2")]).unwrap(),
            "1:2"
        );
        assert_eq!(
            KeyTemplate::parse("{a}{b}"),
            Err(TemplateError::NoSeparator { position: 3 })
        );
        assert_eq!(
            KeyTemplate::parse("{a}-{b}"),
            Err(TemplateError::NoSeparator { position: 4 })
        );
        assert!(KeyTemplate::parse("{a}->>{b}").is_ok());
        assert_eq!(
            render("{cmd.account_id}", &[("cmd.account_id", "9")]).unwrap(),
            "9"
        );
        assert_eq!(render("static", &[]).unwrap(), "static");
        assert_eq!(render("ü:{k}:鍵", &[("k", "ключ")]).unwrap(), "ü:ключ:鍵");
    }

    #[test]
    fn rejects_malformed_templates() {
        assert_eq!(
            KeyTemplate::parse("a{b"),
            Err(TemplateError::Unclosed { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("a<b"),
            Err(TemplateError::Unclosed { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("a}b"),
            Err(TemplateError::Unopened { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("x->y"),
            Err(TemplateError::Unopened { position: 2 })
        );
        assert!(matches!(
            KeyTemplate::parse("{}"),
            Err(TemplateError::BadName { position: 0, .. })
        ));
        assert!(matches!(
            KeyTemplate::parse("{a b}"),
            Err(TemplateError::BadName { .. })
        ));
        // `{a>` is an unclosed `{`, not a `{` closed by `>`.
        assert!(KeyTemplate::parse("{a>").is_err());
    }

    #[test]
    fn missing_value_is_an_error() {
        assert_eq!(
            render("account:{id}", &[]),
            Err(TemplateError::Missing { name: "id".into() })
        );
        let err = crate::LockError::from(TemplateError::Missing { name: "id".into() });
        assert_eq!(err.code(), "DistributedLock.Configuration");
    }

    #[test]
    fn lists_placeholders_and_round_trips() {
        let t: KeyTemplate = "a:{x}:<y>:{x}".parse().unwrap();
        assert_eq!(t.placeholders().collect::<Vec<_>>(), ["x", "y", "x"]);
        assert_eq!(t.to_string(), "a:{x}:<y>:{x}");
        assert_eq!(t.as_str(), "a:{x}:<y>:{x}");
    }

    #[test]
    fn names_follow_the_shared_grammar() {
        // The names the attribute takes: Unicode and raw identifiers, spaces around `.`.
        let t = KeyTemplate::parse("k:{ключ}:{r#type}:{ cmd . id }").unwrap();
        assert_eq!(
            t.placeholders().collect::<Vec<_>>(),
            ["ключ", "type", "cmd.id"]
        );
        assert_eq!(render("k:{r#type}", &[("type", "a:b")]).unwrap(), "k:a%3Ab");
        // Not identifiers or tuple indices.
        for (template, name) in [("k:{1x}", "1x"), ("k:{a..b}", "a..b"), ("k:{_}", "_")] {
            assert_eq!(
                KeyTemplate::parse(template),
                Err(TemplateError::BadName {
                    position: 2,
                    name: name.into()
                }),
            );
        }
        let err = KeyTemplate::parse("k:{a-b}").unwrap_err().to_string();
        assert!(err.contains("at byte 2 has the name `a-b`"), "{err}");
    }

    #[test]
    fn errors_say_where_and_what() {
        let shown = |e: TemplateError| e.to_string();
        assert_eq!(
            shown(TemplateError::Unclosed { position: 3 }),
            "the placeholder opened at byte 3 is not closed (write `{{` or `<<` for a literal `{` or `<`)"
        );
        assert_eq!(
            shown(TemplateError::Unopened { position: 4 }),
            "the `}` or `>` at byte 4 closes nothing (write `}}` or `>>` for a literal `}` or `>`)"
        );
        assert!(
            shown(TemplateError::BadName {
                position: 5,
                name: "a\nb".into()
            })
            .starts_with("the placeholder at byte 5 has the name `a\\nb`;")
        );
        assert!(
            shown(TemplateError::NoSeparator { position: 6 })
                .starts_with("the placeholder at byte 6 needs a `:`")
        );
        assert_eq!(
            shown(TemplateError::Missing { name: "id".into() }),
            "no value for the placeholder `id`"
        );
    }
}
