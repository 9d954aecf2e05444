"""The benchmark's prompt sets: open chat, code, input-grounded work (rewrite, summarize, edit a
passage of 100-300 words given in the prompt, so that prompt lookup has material to copy from), and
repetitive traffic (templated extraction, agent tool calls, code edits: see `repetitive`).

Every prompt is a list of chat messages (one user message, but for the agent turns of the repetitive
set); the chat template is applied by whoever serves it.
"""

from __future__ import annotations

import json

CHAT = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python lists and tuples?",
    "Give me three practical tips for getting better sleep.",
    "Describe how a bicycle works to a ten-year-old.",
    "What causes the seasons on Earth?",
    "Write a friendly email inviting a colleague to lunch on Friday.",
    "What is the difference between weather and climate?",
    "Suggest a name and a short description for a new coffee shop.",
    "Why do cats purr?",
]

CODE = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number, computed iteratively.",
    "Write a JavaScript function that removes duplicate values from an array.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Write a Python class for a simple stack with push, pop and peek methods.",
    "Write a bash script that counts the lines of every .txt file in a folder.",
    "Write a Python function that reads a CSV file and returns the average of one column.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a C function that reverses a string in place.",
    "Explain what a Python list comprehension is, with an example.",
]

_TEAM = """hey everyone, so the project is kind of behind right now and honestly it's nobody's fault \
really, the client changed their mind like three times about the design and we had to redo the \
homepage twice. anyway we need to get the checkout page done by next friday or we're gonna be in \
trouble. sam can you take the payment stuff? you did it last time and it was pretty good. maria \
is gonna handle the layout and the mobile version since she knows the new design best. i'll deal \
with the client and try to stop them from changing stuff again lol. if anybody is stuck just ping \
me on chat, don't wait until the meeting on monday because that's too late. also please please \
update the task board when you finish something, last week nobody did and i had no idea what was \
going on. thanks guys, we can do this, it's just one more week of pushing and then we can relax \
a bit before the next phase starts."""

_BICYCLE = """The bicycle as we know it took most of the nineteenth century to appear. In 1817 the \
German inventor Karl Drais built the running machine, a wooden frame with two wheels in line that \
the rider pushed along with his feet. It had no pedals, but it proved that a person could balance \
on two wheels while moving. In the 1860s French makers attached pedals and cranks directly to the \
front wheel. These machines, called velocipedes, were heavy and rattled so badly on cobblestones \
that people nicknamed them boneshakers. To go faster with pedals fixed to the wheel, builders made \
the front wheel larger and larger, which led to the high-wheeler of the 1870s. It was fast but \
dangerous, since a rider sat high above the ground and could be thrown over the handlebars by a \
small stone. The safety bicycle of the 1880s solved this with two wheels of equal size and a chain \
that drove the rear wheel. When air-filled rubber tyres arrived in 1888, the ride became smooth, \
and cycling spread quickly among ordinary people."""

_ERRORS = """Last summer me and my family goes to the mountains for a week. We was staying in a \
small cabin near a lake, it had no internet and the phone signal were very weak. At first my \
brother complain all the time because he could not play his games online. But after two days he \
start to enjoy fishing with our father, and he catched a big trout on the third morning. My mother \
readed three books on the porch and said it was the most relaxing week she have in years. I walked \
every day on the trails and seen deers, a fox and many kind of birds. In the evening we cooked on \
a fire and tell stories until it was to dark to see. When we drived home, nobody wanted to leave \
and we promised to come back next year for two weeks instead of one."""

_CODE_DOC = '''def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            customer, amount, date = line.split(",")
            orders.append({"customer": customer, "amount": float(amount), "date": date})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals


def top_customers(orders, n):
    totals = total_by_customer(orders)
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return ranked[:n]


def monthly_totals(orders):
    months = {}
    for order in orders:
        month = order["date"][:7]
        months[month] = months.get(month, 0.0) + order["amount"]
    return dict(sorted(months.items()))


def write_report(orders, path, n=10):
    with open(path, "w") as f:
        f.write("Top customers\n")
        for customer, total in top_customers(orders, n):
            f.write(f"{customer}: {total:.2f}\n")
        f.write("\nMonthly totals\n")
        for month, total in monthly_totals(orders).items():
            f.write(f"{month}: {total:.2f}\n")'''

_RECYCLING = """Starting on the first of March, the city will collect recycling every week instead \
of every two weeks. Each household will receive a new blue bin with wheels and a lid, delivered \
free of charge during February. The blue bin is for paper, cardboard, glass bottles and jars, \
metal cans and plastic bottles. Plastic bags, food waste and broken glass must not go in the blue \
bin, because they jam the sorting machines. Food waste goes in the small green caddy, which is \
collected on the same day. Bins must be placed at the edge of the pavement by seven in the \
morning and brought back in by the evening. Residents who live in apartment buildings will share \
large bins that the building manager will place in the courtyard. The old orange boxes can be \
kept for storage or returned to any of the four recycling centres, where they will be turned into \
new bins. The city expects the change to raise the share of household waste that is recycled from \
thirty-eight to fifty percent within two years."""

_PHOTOSYNTHESIS = """Photosynthesis is the process by which green plants, algae and some bacteria \
convert light energy into chemical energy stored in sugar. It takes place mainly in the \
chloroplasts of leaf cells, which contain the pigment chlorophyll. Chlorophyll absorbs red and \
blue light strongly and reflects green light, which is why leaves look green. In the first stage, \
the light-dependent reactions, absorbed light is used to split water molecules, releasing oxygen \
as a by-product and producing the energy carriers ATP and NADPH. In the second stage, known as the \
Calvin cycle, the plant uses ATP and NADPH to fix carbon dioxide from the air into three-carbon \
molecules, which are then assembled into glucose and other sugars. The plant uses these sugars \
for energy and as building blocks for cellulose and starch. Almost all life on Earth depends on \
photosynthesis, directly or indirectly, both for food and for the oxygen in the atmosphere."""

_EMAIL = """Dear Ms. Patel, thank you for your message of last Tuesday and for your patience while \
we looked into the problem with your order. I am sorry that the desk lamp you ordered arrived \
with a cracked base. Our warehouse team has checked the packing records, and it seems that the \
box was damaged during transport rather than before it left us. We have already sent a \
replacement lamp by express delivery, and it should reach you on Thursday or Friday this week. \
You do not need to return the damaged lamp; please recycle it or dispose of it as you prefer. In \
addition, we have refunded the delivery charge of six pounds fifty to your card, which may take \
three to five working days to appear on your statement. If the new lamp is not with you by \
Saturday, or if there is any other problem, please reply to this email or call our customer \
service team on the number below, and we will sort it out straight away. Kind regards, James \
Whitfield, Customer Service."""

_CODE_RENAME = '''def summarize(scores):
    tmp = 0
    count = 0
    best = None
    for name, value in scores.items():
        if value is None:
            continue
        tmp += value
        count += 1
        if best is None or value > scores[best]:
            best = name
    average = tmp / count if count else 0.0
    print("total:", tmp)
    print("average:", average)
    print("best:", best)
    return {"total": tmp, "average": average, "best": best, "count": count}


def report(groups):
    for group, scores in groups.items():
        result = summarize(scores)
        if result["count"] == 0:
            print(group, "has no scores yet")
            continue
        tmp = result["total"]
        print(group, "total", tmp, "from", result["count"], "scores")
        if tmp > 100:
            print(group, "passed the threshold of 100 with", tmp)'''

_MARKET = """The old covered market in the town centre reopens this Saturday after eighteen months \
of repairs. The iron roof, built in 1889, has been taken apart piece by piece, cleaned, painted \
and put back with new glass panels that let in far more daylight than before. The stone floor has \
been levelled, and the forty wooden stalls have been rebuilt using timber from the original \
structure wherever possible. Twenty-eight traders have signed up so far, selling fruit, \
vegetables, cheese, bread, fish, flowers and second-hand books, and a small cafe will open in the \
north corner. The market will be open from eight in the morning until four in the afternoon from \
Tuesday to Saturday, with a late opening until eight on Thursdays. The council paid for most of \
the work, with help from a national heritage fund and donations from local residents."""

GROUNDED = [
    "Rewrite the following message in a formal, professional tone. Keep all the information.\n\n" + _TEAM,
    "Summarize the following passage in three sentences.\n\n" + _BICYCLE,
    "Correct the grammar and spelling mistakes in the following text. Return the corrected text.\n\n" + _ERRORS,
    "Add a docstring and type hints to every function in the following Python code. Return the full code.\n\n"
    + _CODE_DOC,
    "Turn the following announcement into a list of bullet points.\n\n" + _RECYCLING,
    "Rewrite the following passage in simple English for a twelve-year-old.\n\n" + _PHOTOSYNTHESIS,
    "Summarize the following email in two sentences.\n\n" + _EMAIL,
    "Rename the variable tmp to total in the following Python code. Return the full code.\n\n" + _CODE_RENAME,
    "Rewrite the following news item as a short announcement for the market's website, keeping all the "
    "facts.\n\n" + _MARKET,
]

GROUNDED_SET = "grounded"
CORE_SETS = ("chat", "code", GROUNDED_SET)  # the sets the pooled summary keys are over (repetitive has keys of its own)


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# The repetitive set: what templated and agentic traffic looks like to a suffix index. Three kinds of
# single-turn request, interleaved (item i is kind i % 3, so any prefix holds all three), each kind
# with a fixed instruction and output format and an input that differs in every item: an extraction
# service (the same JSON fields from a new message), an agent loop (the same tool list, a new task
# and tool result, answered by a tool-call JSON object) and code edits (a short function and an edit
# that asks for the whole function back). Held out: nothing in the project is tuned on it (the
# suffix proposer's parameters come from benchmarks/suffix_lookup.py's synthetic data).
#
# Item j of a kind picks each field as values[j % len(values)]; the lengths are chosen so that the
# tuple of picks repeats only after thousands of items, so every item's input is distinct: items
# 0..23 (the set) and REPETITIVE_HISTORY_START.. (the unmeasured history a benchmark row's tenant
# has served before it) never share an input.

REPETITIVE_SET = "repetitive"
REPETITIVE_KINDS = ("extraction", "tool_call", "code_edit")
REPETITIVE_SIZE = 24
REPETITIVE_HISTORY_START = 999  # a multiple of 3: the history interleaves the kinds like the set

_EXTRACT_INSTRUCTION = (
    "Extract the following fields from the message below: the sender's name, the sender's company, the city, "
    "the date and the amount. Answer with a JSON object only, in exactly this format:\n"
    '{"name": "...", "company": "...", "city": "...", "date": "...", "amount": "..."}\n\nMessage:\n')
_EXTRACT_TEMPLATES = (
    "Hello, this is {name} from {company}. Please find attached our invoice for the {item} delivered to your "
    "warehouse in {city} on {date}. The total due is {amount}, payable within thirty days. Thank you for your "
    "business.",
    "Dear accounts team, I am writing on behalf of {company} about the order of {item} that we shipped to {city}. "
    "Our records show a payment of {amount} received on {date}, but the order is still marked as unpaid in your "
    "portal. Could you check this? Best regards, {name}",
    "Hi! Quick reminder from {name} ({company}): the quote for the {item} is {amount}, valid until {date}. "
    "Installation would be done by our team in {city}. Let me know if you want to go ahead.",
    "Subject: refund request. Good morning, my name is {name} and I work for {company} in {city}. On {date} we "
    "were charged {amount} twice for the same delivery of {item}. Please refund the duplicate charge.",
)
_NAMES = ("Anna Keller", "Marco Rossi", "Priya Nair", "Tom Becker", "Lucia Fernandez", "Kenji Sato",
          "Olga Ivanova", "David Okafor", "Sara Lindqvist", "Ahmed Haddad", "Emily Clarke")
_COMPANIES = ("Northwind Traders", "Bluefin Logistics", "Greenleaf Foods", "Atlas Engineering",
              "Brightpath Software", "Harbor Textiles", "Summit Medical Supplies", "Redwood Furniture",
              "Clearwater Energy")
_CITIES = ("Lisbon", "Rotterdam", "Toronto", "Melbourne", "Osaka", "Nairobi", "Denver")
_DATES = ("3 March 2025", "17 January 2025", "28 February 2025", "9 April 2025", "21 May 2025", "2 June 2025",
          "14 July 2025", "30 August 2025", "11 September 2025", "6 October 2025", "19 November 2025",
          "1 December 2025", "24 December 2025")
_AMOUNTS = ("EUR 1,240.00", "USD 389.50", "GBP 2,015.75", "EUR 76.20", "USD 12,480.00")
_ITEMS = ("office chairs", "printer toner", "server racks", "safety helmets", "coffee beans", "LED panels")

_TOOLS = (
    {"name": "search_flights", "description": "Find flights between two cities on a date",
     "parameters": {"origin": "string", "destination": "string", "date": "YYYY-MM-DD"}},
    {"name": "book_flight", "description": "Book a flight returned by search_flights",
     "parameters": {"flight_id": "string", "passenger": "string"}},
    {"name": "get_weather", "description": "The weather forecast for a city on a date",
     "parameters": {"city": "string", "date": "YYYY-MM-DD"}},
    {"name": "send_email", "description": "Send an email",
     "parameters": {"to": "string", "subject": "string", "body": "string"}},
    {"name": "lookup_customer", "description": "Find a customer by email address",
     "parameters": {"email": "string"}},
    {"name": "create_ticket", "description": "Open a support ticket for a customer",
     "parameters": {"customer_id": "string", "priority": "low|normal|high", "summary": "string"}},
)
_AGENT_SYSTEM = (
    "You are an assistant that completes tasks by calling tools. Reply with exactly one JSON object of the form "
    '{"tool": "<tool name>", "arguments": {...}} and nothing else. After each call you get the tool\'s result. '
    "Available tools:\n" + "\n".join(json.dumps(tool) for tool in _TOOLS))
_ISO_DATES = ("2025-03-14", "2025-04-02", "2025-05-19", "2025-06-07", "2025-07-23", "2025-08-11", "2025-09-30")
_ROUTES = (("Madrid", "Vienna"), ("Chicago", "Boston"), ("Seoul", "Singapore"), ("Dublin", "Prague"),
           ("Lima", "Santiago"), ("Oslo", "Hamburg"), ("Cairo", "Athens"), ("Perth", "Auckland"),
           ("Montreal", "Miami"), ("Zurich", "Stockholm"), ("Delhi", "Dubai"))
_EMAILS = ("j.moreau@example.com", "li.wei@example.org", "k.schmidt@example.net", "a.silva@example.com",
           "m.brown@example.org", "r.gupta@example.net", "n.kowalski@example.com", "e.dubois@example.org",
           "t.yamada@example.net", "h.jensen@example.com", "c.romero@example.org", "s.ali@example.net",
           "p.novak@example.com")
_FORECASTS = (("light rain", 14, 8), ("sunny", 27, 16), ("overcast", 11, 5), ("thunderstorms", 22, 17),
              ("snow showers", -1, -6))
_PROBLEMS = ("the export to CSV fails with an error", "they cannot log in since the last update",
             "invoices show the wrong currency", "the mobile app crashes on start",
             "two users see each other's dashboards")


def _tool_call(tool: str, **arguments) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


def _agent_turn(j: int) -> list[dict]:
    """A task, the agent's first tool call and its result: the answer is the next tool call."""
    date, email = _ISO_DATES[j % len(_ISO_DATES)], _EMAILS[j % len(_EMAILS)]
    name = _NAMES[j % len(_NAMES)]
    origin, destination = _ROUTES[j % len(_ROUTES)]
    if j % 3 == 0:
        task = f"Book the cheapest flight from {origin} to {destination} on {date} for {name}."
        call = _tool_call("search_flights", origin=origin, destination=destination, date=date)
        price = 90 + 37 * (j % 13)
        result = {"flights": [{"flight_id": f"SX{400 + j % 97}", "price": price + 64, "departs": "07:40"},
                              {"flight_id": f"KL{120 + j % 89}", "price": price, "departs": "13:05"},
                              {"flight_id": f"AZ{700 + j % 83}", "price": price + 18, "departs": "19:20"}]}
    elif j % 3 == 1:
        task = f"Check the weather in {destination} on {date} and email the forecast to {email}."
        call = _tool_call("get_weather", city=destination, date=date)
        sky, high, low = _FORECASTS[j % len(_FORECASTS)]
        result = {"city": destination, "date": date, "forecast": sky, "high_c": high, "low_c": low}
    else:
        problem, priority = _PROBLEMS[j % len(_PROBLEMS)], ("normal", "high", "low", "high")[j % 4]
        task = f"The customer {email} reports that {problem}. Open a {priority} priority ticket for them."
        call = _tool_call("lookup_customer", email=email)
        result = {"customer_id": f"C-{48000 + 173 * j % 9973}", "name": name, "email": email,
                  "plan": ("business", "starter", "enterprise")[j % 3]}
    return [{"role": "system", "content": _AGENT_SYSTEM}, {"role": "user", "content": task},
            {"role": "assistant", "content": call},
            {"role": "user", "content": "Tool result: " + json.dumps(result)}]


_FUNCTIONS = (  # (function names, body with {fn} and {var})
    (("order_total", "cart_total", "invoice_total"), '''def {fn}(items, rate):
    {var} = 0.0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discounted"):
            price = price * (1 - rate)
        {var} += price
    return round({var}, 2)'''),
    (("count_words", "word_frequencies", "tally_words"), '''def {fn}(text):
    {var} = {{}}
    for line in text.splitlines():
        for word in line.lower().split():
            word = word.strip(".,;:!?")
            if word:
                {var}[word] = {var}.get(word, 0) + 1
    return {var}'''),
    (("moving_average", "rolling_mean", "smooth"), '''def {fn}(values, window):
    {var} = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        {var}.append(sum(chunk) / window)
    return {var}'''),
    (("parse_config", "read_settings", "load_options"), '''def {fn}(path):
    {var} = {{}}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            {var}[key.strip()] = value.strip()
    return {var}'''),
    (("find_duplicates", "repeated_items", "duplicates"), '''def {fn}(items):
    seen = set()
    {var} = []
    for item in items:
        if item in seen and item not in {var}:
            {var}.append(item)
        seen.add(item)
    return {var}'''),
)
_OLD_NAMES = ("acc", "tmp", "res", "out", "buf", "data", "x")
_NEW_NAMES = ("result", "collected", "answer", "output", "accumulator", "values", "found", "gathered",
              "totals", "entries", "summary")
_EDITS = (
    "Rename the variable {var} to {new} in the following Python function. Return the full function.",
    "Add a docstring to the following Python function that says what it does and what it returns. Return the "
    "full function.",
    "Add type hints to the parameters and the return value of the following Python function. Return the full "
    "function.",
    "Add a keyword parameter verbose=False to the following Python function; when it is true, print the value of "
    "{var} before returning it. Return the full function.",
)


def _code_edit(j: int) -> list[dict]:
    names, body = _FUNCTIONS[j % len(_FUNCTIONS)]
    var = _OLD_NAMES[j % len(_OLD_NAMES)]
    edit = _EDITS[j % len(_EDITS)].format(var=var, new=_NEW_NAMES[j % len(_NEW_NAMES)])
    return messages(edit + "\n\n" + body.format(fn=names[j % len(names)], var=var))


def _extraction(j: int) -> list[dict]:
    template = _EXTRACT_TEMPLATES[j % len(_EXTRACT_TEMPLATES)]
    return messages(_EXTRACT_INSTRUCTION + template.format(
        name=_NAMES[j % len(_NAMES)], company=_COMPANIES[j % len(_COMPANIES)], city=_CITIES[j % len(_CITIES)],
        date=_DATES[j % len(_DATES)], amount=_AMOUNTS[j % len(_AMOUNTS)], item=_ITEMS[j % len(_ITEMS)]))


def repetitive_kind(index: int) -> str:
    return REPETITIVE_KINDS[index % len(REPETITIVE_KINDS)]


def repetitive(n: int, start: int = 0) -> list[list[dict]]:
    """Items start..start+n of the repetitive set, as chat messages (see above)."""
    make = {"extraction": _extraction, "tool_call": _agent_turn, "code_edit": _code_edit}
    return [make[repetitive_kind(i)](i // len(REPETITIVE_KINDS)) for i in range(start, start + n)]


SETS: dict[str, list[str] | list[list[dict]]] = {"chat": CHAT, "code": CODE, "grounded": GROUNDED,
                                                 REPETITIVE_SET: repetitive(REPETITIVE_SIZE)}


def take(name: str, n: int | None) -> list[list[dict]]:
    """The first n prompts of a set as chat messages (all of them when n is None; cycled when n is
    larger than the set, but for the repetitive set, which makes n distinct items for any n)."""
    if name == REPETITIVE_SET:
        return repetitive(REPETITIVE_SIZE if n is None else n)
    prompts = SETS[name]
    n = len(prompts) if n is None else n
    return [messages(prompts[i % len(prompts)]) for i in range(n)]
