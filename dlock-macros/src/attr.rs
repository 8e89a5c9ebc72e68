//! Parsing: the attribute's arguments and the key template.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, ExprUnary, Ident, Lit, LitStr, Token, UnOp};

mod kw {
    syn::custom_keyword!(timeout);
    syn::custom_keyword!(provider);
    syn::custom_keyword!(guard);
}

/// The options, as listed in error messages.
const OPTIONS: &str = "`timeout = <seconds>`, `provider = <expr>` and `guard = <name>`";

/// The arguments of `#[distributed_lock("template", option = value, ...)]`.
pub(crate) struct Args {
    pub(crate) template: Template,
    pub(crate) timeout: Option<Timeout>,
    pub(crate) provider: Option<(kw::provider, Expr)>,
    pub(crate) guard: Option<(kw::guard, Ident)>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.is_empty() {
            return Err(syn::Error::new(
                Span::call_site(),
                "#[distributed_lock] needs a key template, such as \
                 #[distributed_lock(\"account:{account_id}\", timeout = 10)]",
            ));
        }
        let lit: LitStr = input.parse().map_err(|err| {
            syn::Error::new(
                err.span(),
                "the first argument of #[distributed_lock] is the key template, a string \
                 literal such as \"account:{account_id}\"",
            )
        })?;
        let template = Template::parse(&lit)?;
        let mut args = Args {
            template,
            timeout: None,
            provider: None,
            guard: None,
        };
        while !input.is_empty() {
            input.parse::<Token![,]>()?;
            if input.is_empty() {
                break;
            }
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::timeout) {
                let keyword: kw::timeout = input.parse()?;
                reject_duplicate(args.timeout.is_some(), keyword.span, "timeout")?;
                input.parse::<Token![=]>()?;
                args.timeout = Some(Timeout::parse(input.parse()?)?);
            } else if lookahead.peek(kw::provider) {
                let keyword: kw::provider = input.parse()?;
                reject_duplicate(args.provider.is_some(), keyword.span, "provider")?;
                input.parse::<Token![=]>()?;
                args.provider = Some((keyword, input.parse()?));
            } else if lookahead.peek(kw::guard) {
                let keyword: kw::guard = input.parse()?;
                reject_duplicate(args.guard.is_some(), keyword.span, "guard")?;
                input.parse::<Token![=]>()?;
                let name = input.call(Ident::parse_any).map_err(|err| {
                    syn::Error::new(
                        err.span(),
                        "`guard` names the variable that holds the lock's guard in the body, \
                         such as `guard = lock`",
                    )
                })?;
                args.guard = Some((keyword, name));
            } else if input.peek(Ident::peek_any) {
                let name = input.call(Ident::parse_any)?;
                return Err(syn::Error::new(
                    name.span(),
                    format!("unknown option `{name}`; the options are {OPTIONS}"),
                ));
            } else {
                return Err(syn::Error::new(
                    input.span(),
                    format!("expected an option; the options are {OPTIONS}"),
                ));
            }
        }
        Ok(args)
    }
}

fn reject_duplicate(seen: bool, span: Span, name: &str) -> syn::Result<()> {
    if seen {
        Err(syn::Error::new(
            span,
            format!("duplicate option `{name}`: give it once"),
        ))
    } else {
        Ok(())
    }
}

/// `timeout = <seconds>`: a non-negative integer or decimal literal.
pub(crate) struct Timeout {
    secs: u64,
    nanos: u32,
}

impl Timeout {
    fn parse(value: Expr) -> syn::Result<Self> {
        const HELP: &str = "the timeout is a number of seconds, such as `timeout = 10` or \
                            `timeout = 0.25` (`timeout = 0` tries once)";
        let bad = |message: &str| Err(syn::Error::new(value.span(), message));
        let duration = match &value {
            Expr::Lit(ExprLit {
                lit: Lit::Int(int), ..
            }) if int.suffix().is_empty() => match int.base10_parse::<u64>() {
                Ok(secs) => std::time::Duration::from_secs(secs),
                Err(_) => return bad("the timeout is too large"),
            },
            Expr::Lit(ExprLit {
                lit: Lit::Float(float),
                ..
            }) if float.suffix().is_empty() => {
                let secs = float.base10_parse::<f64>()?;
                match std::time::Duration::try_from_secs_f64(secs) {
                    Ok(duration) => duration,
                    Err(_) => return bad("the timeout is too large"),
                }
            }
            Expr::Unary(ExprUnary {
                op: UnOp::Neg(_), ..
            }) => return bad(&format!("the timeout cannot be negative; {HELP}")),
            _ => return bad(HELP),
        };
        Ok(Timeout {
            secs: duration.as_secs(),
            nanos: duration.subsec_nanos(),
        })
    }

    /// The timeout as a `Duration` expression.
    pub(crate) fn tokens(timeout: Option<&Timeout>) -> TokenStream {
        let (secs, nanos) = timeout.map_or((0, 0), |t| (t.secs, t.nanos));
        quote!(::core::time::Duration::new(#secs, #nanos))
    }
}

/// A parsed key template: literal text and placeholders, in order.
pub(crate) struct Template {
    pub(crate) lit: LitStr,
    pub(crate) parts: Vec<Part>,
}

pub(crate) enum Part {
    /// Text copied into the key as it is (escapes already resolved).
    Literal(String),
    Placeholder(Placeholder),
}

/// `{root.member.member}` or `<root.member>`.
pub(crate) struct Placeholder {
    /// As written, for error messages.
    pub(crate) written: String,
    /// The parameter or field it starts from, without `r#`.
    pub(crate) root: String,
    /// Field names or tuple indices reached into from the root.
    pub(crate) members: Vec<String>,
}

/// Characters whose presence in the text between two placeholders makes keys injective: values
/// never contain them unencoded.
fn is_separator(c: char) -> bool {
    matches!(c, ':' | '{' | '}' | '<' | '>') || c.is_control()
}

impl Template {
    fn parse(lit: &LitStr) -> syn::Result<Self> {
        let text = lit.value();
        let err = |message: String| syn::Error::new(lit.span(), message);
        if text.is_empty() {
            return Err(err(
                "the key template is empty; a lock key needs text, such as \"account:{account_id}\""
                    .to_owned(),
            ));
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' | '<' | '}' | '>' if chars.peek().is_some_and(|&(_, next)| next == c) => {
                    chars.next();
                    literal.push(c);
                }
                '{' | '<' => {
                    let close = if c == '{' { '}' } else { '>' };
                    let rest = &text[at + 1..];
                    let Some(len) = rest.find(close) else {
                        return Err(err(format!(
                            "unclosed `{c}` in the key template: close the placeholder with \
                             `{close}`, or write `{c}{c}` for a literal `{c}`"
                        )));
                    };
                    let written = format!("{c}{}{close}", &rest[..len]);
                    let placeholder = Placeholder::parse(&rest[..len], written).map_err(err)?;
                    for _ in 0..rest[..len].chars().count() + 1 {
                        chars.next();
                    }
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    if let Some(Part::Placeholder(previous)) = parts.last() {
                        return Err(err(format!(
                            "placeholders `{}` and `{}` need a `:` between them: without one, \
                             distinct values could give the same key (\"ab\" + \"c\" and \"a\" + \"bc\")",
                            previous.written, placeholder.written
                        )));
                    }
                    if let (Some(Part::Literal(between)), Some(Part::Placeholder(previous))) =
                        (parts.last(), parts.len().checked_sub(2).map(|i| &parts[i]))
                    {
                        if !between.chars().any(is_separator) {
                            return Err(err(format!(
                                "placeholders `{}` and `{}` need a `:` between them: with only \
                                 `{between}`, distinct values could give the same key",
                                previous.written, placeholder.written
                            )));
                        }
                    }
                    parts.push(Part::Placeholder(placeholder));
                }
                '}' | '>' => {
                    return Err(err(format!(
                        "unmatched `{c}` in the key template; write `{c}{c}` for a literal `{c}`"
                    )));
                }
                _ => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Template {
            lit: lit.clone(),
            parts,
        })
    }

    /// The length of the literal text, to size the key's buffer.
    pub(crate) fn literal_len(&self) -> usize {
        self.parts
            .iter()
            .map(|part| match part {
                Part::Literal(text) => text.len(),
                Part::Placeholder(_) => 8,
            })
            .sum()
    }
}

impl Placeholder {
    fn parse(inner: &str, written: String) -> Result<Self, String> {
        let inner = inner.trim();
        if inner.is_empty() {
            return Err(format!(
                "empty placeholder `{written}`: name a parameter or field, such as \
                 `{{account_id}}`; double the braces for literal text (`{{{{}}}}`)"
            ));
        }
        let mut segments = inner.split('.').map(str::trim);
        let root = segments.next().unwrap_or_default();
        let members: Vec<String> = segments.map(str::to_owned).collect();
        let valid = |s: &str, index_ok: bool| {
            is_identifier(s) || (index_ok && !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        };
        if !valid(root, true) || !members.iter().all(|m| valid(m, true)) {
            return Err(format!(
                "invalid placeholder `{written}`: a placeholder names a parameter or field, \
                 optionally followed by `.field`s, such as `{{account_id}}` or `{{cmd.account_id}}`"
            ));
        }
        Ok(Placeholder {
            root: root.strip_prefix("r#").unwrap_or(root).to_owned(),
            members,
            written,
        })
    }
}

fn is_identifier(s: &str) -> bool {
    let s = s.strip_prefix("r#").unwrap_or(s);
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|first| first == '_' || first.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
        && s != "_"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(template: &str) -> Result<Vec<String>, String> {
        let lit = LitStr::new(template, Span::call_site());
        Template::parse(&lit)
            .map(|t| {
                t.parts
                    .iter()
                    .map(|part| match part {
                        Part::Literal(text) => format!("lit {text}"),
                        Part::Placeholder(p) => {
                            let mut path = vec![p.root.clone()];
                            path.extend(p.members.iter().cloned());
                            format!("var {}", path.join("."))
                        }
                    })
                    .collect()
            })
            .map_err(|err| err.to_string())
    }

    #[test]
    fn both_spellings_are_one_placeholder() {
        let expected = ["lit account:", "var account_id"];
        assert_eq!(parse("account:{account_id}").unwrap(), expected);
        assert_eq!(parse("account:<account_id>").unwrap(), expected);
        assert_eq!(parse("account:< account_id >").unwrap(), expected);
    }

    #[test]
    fn paths_indices_and_raw_identifiers() {
        assert_eq!(
            parse("t:{cmd.owner.0}:<self.name>:{r#type}").unwrap(),
            [
                "lit t:",
                "var cmd.owner.0",
                "lit :",
                "var self.name",
                "lit :",
                "var type"
            ]
        );
    }

    #[test]
    fn doubled_delimiters_are_literal() {
        assert_eq!(parse("{{a}}<<b>>:{x}").unwrap(), ["lit {a}<b>:", "var x"]);
        assert_eq!(
            parse("a:{x}{{:{y}").unwrap(),
            ["lit a:", "var x", "lit {:", "var y"]
        );
    }

    #[test]
    fn placeholders_need_a_separator() {
        assert!(parse("{a}{b}").unwrap_err().contains("need a `:`"));
        assert!(parse("{a}-{b}").unwrap_err().contains("with only `-`"));
        assert!(parse("{a}/x/{b}").is_err());
        for ok in ["{a}:{b}", "{a}<<{b}", "{a}}}{b}", "{a}\n{b}", "{a}-:-{b}"] {
            assert!(parse(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn malformed_templates() {
        let cases = [
            ("", "the key template is empty"),
            ("a:{b", "unclosed `{`"),
            ("a:<b", "unclosed `<`"),
            ("a:{b>", "unclosed `{`"),
            ("a}", "unmatched `}`"),
            ("a>", "unmatched `>`"),
            ("a:{}", "empty placeholder `{}`"),
            ("a:{b c}", "invalid placeholder `{b c}`"),
            ("a:{b.}", "invalid placeholder"),
            ("a:{1x}", "invalid placeholder"),
            ("a:{_}", "invalid placeholder"),
        ];
        for (template, message) in cases {
            let err = parse(template).unwrap_err();
            assert!(err.contains(message), "{template:?}: {err}");
        }
    }

    #[test]
    fn timeouts() {
        let secs = |tokens: &str| {
            let args: Args = syn::parse_str(&format!("\"k\", timeout = {tokens}"))
                .map_err(|err| err.to_string())?;
            let t = args.timeout.unwrap();
            Ok::<_, String>((t.secs, t.nanos))
        };
        assert_eq!(secs("10"), Ok((10, 0)));
        assert_eq!(secs("0"), Ok((0, 0)));
        assert_eq!(secs("0.25"), Ok((0, 250_000_000)));
        assert_eq!(secs("1_000"), Ok((1000, 0)));
        assert!(secs("-1").unwrap_err().contains("cannot be negative"));
        assert!(secs("10ms").unwrap_err().contains("number of seconds"));
        assert!(secs("1e300").unwrap_err().contains("too large"));
        assert!(secs("x").unwrap_err().contains("number of seconds"));
    }
}
