"""The benchmark's prompt sets: open chat, code, and input-grounded work (rewrite, summarize, edit a
passage of 100-300 words given in the prompt, so that prompt lookup has material to copy from).

Every prompt is one user message; the chat template is applied by whoever serves it.
"""

from __future__ import annotations

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

SETS: dict[str, list[str]] = {"chat": CHAT, "code": CODE, "grounded": GROUNDED}
GROUNDED_SET = "grounded"


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def take(name: str, n: int | None) -> list[list[dict]]:
    """The first n prompts of a set as chat messages (all of them when n is None; cycled when n is
    larger than the set)."""
    prompts = SETS[name]
    n = len(prompts) if n is None else n
    return [messages(prompts[i % len(prompts)]) for i in range(n)]
